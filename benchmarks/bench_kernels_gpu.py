"""Fused kernels vs torch: softmax (vs torch.softmax and the naive 5-kernel chain), add+LayerNorm, bias+GELU.

Run: ``python -m fxforge.benchmarks.bench_kernels_gpu``. With CUDA: GB/s (bytes that must move / time,
``triton.testing.do_bench`` medians) and the fraction of the device's DRAM bandwidth over widths
128 ... 16384 (MASE tutorial 9's plot). Without CUDA it says so and instead checks every Triton kernel
against its torch reference under ``TRITON_INTERPRET=1`` (tiny shapes, forward and backward max abs diff).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch.nn.functional as F  # noqa: E402

from ..kernels import activation, afno, layernorm, row_softmax  # noqa: E402
from ..kernels.dispatch import kernel_backend, triton_available  # noqa: E402

WIDTHS = [128 * 2**i for i in range(8)]  # 128 ... 16384


def naive_softmax(x: torch.Tensor) -> torch.Tensor:
    x_max = x.max(dim=-1, keepdim=True)[0]
    num = torch.exp(x - x_max)
    return num / num.sum(dim=-1, keepdim=True)


def dram_gbps() -> float:
    """Peak DRAM bandwidth of the current device from Triton's driver (memory clock x bus width x 2)."""
    import triton

    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    return 2 * props["mem_clock_rate"] * 1e3 * props["mem_bus_width"] / 8 / 1e9


def gpu_table(rows: int = 4096) -> None:
    import triton

    peak = dram_gbps()
    print(f"{torch.cuda.get_device_name()}: peak DRAM {peak:.0f} GB/s, {rows} rows fp32; GB/s (fraction of peak)")
    cases = {
        "softmax": (lambda x, r, b: row_softmax.softmax(x), lambda x, r, b: torch.softmax(x, -1),
                    lambda x, r, b: naive_softmax(x), 2),
        "add+layernorm": (lambda x, r, b: layernorm.add_layer_norm(x, r, b, b, 1e-5),
                          lambda x, r, b: F.layer_norm(x + r, (x.shape[-1],), b, b, 1e-5), None, 4),
        "bias+gelu": (lambda x, r, b: activation.bias_gelu(x, b, "none"), lambda x, r, b: F.gelu(x + b), None, 2),
    }
    for name, (fused, torch_fn, naive, passes) in cases.items():
        print(f"\n{name}: width  fused  torch" + ("  naive" if naive else ""))
        for width in WIDTHS:
            x = torch.randn(rows, width, device="cuda")
            r, b = torch.randn_like(x), torch.randn(width, device="cuda")
            moved = passes * x.numel() * x.element_size()
            cells = []
            for fn in (fused, torch_fn, naive):
                if fn is None:
                    continue
                ms = triton.testing.do_bench(lambda fn=fn, x=x, r=r, b=b: fn(x, r, b))
                gbps = moved / (ms * 1e-3) / 1e9
                cells.append(f"{gbps:7.0f} ({gbps / peak:4.0%})")
            print(f"  {width:6d} " + " ".join(cells))


def interpreter_check() -> dict[str, tuple[float, float]]:
    """Max abs diff (forward, backward) of every Triton kernel vs its reference under the interpreter."""
    gen = torch.Generator().manual_seed(0)

    def leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]

    mask = torch.zeros(2, 1, 1, 11)
    mask[1, ..., 7:] = torch.finfo(torch.float32).min
    mode_mask = (torch.arange(5) < 4).float()
    cases: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[torch.Tensor], tuple[Any, ...]]] = {
        "softmax (13 wide)": (row_softmax.softmax, row_softmax.softmax_reference, leaves((6, 13)), ()),
        "scaled_masked_softmax": (row_softmax.scaled_masked_softmax, row_softmax.scaled_masked_softmax_reference,
                                  leaves((2, 3, 5, 11)), (mask, 0.35)),
        "layer_norm (19 wide)": (layernorm.layer_norm, layernorm.layer_norm_reference,
                                 leaves((4, 19), (19,), (19,)), (1e-5,)),
        "add_layer_norm": (layernorm.add_layer_norm, layernorm.add_layer_norm_reference,
                           leaves((4, 19), (4, 19), (19,), (19,)), (1e-5,)),
        "bias_gelu": (activation.bias_gelu, activation.bias_gelu_reference, leaves((5, 23), (23,)), ("none",)),
        "bias_gelu tanh": (activation.bias_gelu, activation.bias_gelu_reference, leaves((5, 23), (23,)), ("tanh",)),
        "bias_relu": (activation.bias_relu, activation.bias_relu_reference, leaves((5, 23), (23,)), ()),
        "afno_mlp": (afno.afno_mlp, afno.afno_mlp_reference,
                     [t.mul(0.3).detach().requires_grad_() for t in
                      leaves((2, 5, 3, 6, 2), (2, 3, 6, 6), (2, 3, 6), (2, 3, 6, 6), (2, 3, 6))], (mode_mask, 0.01)),
    }
    out = {}
    for name, (fn, ref, xs, consts) in cases.items():
        with kernel_backend("triton"):
            got = fn(*xs, *consts)
        want = ref(*xs, *consts)
        got_t, want_t = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        fwd = max((g - w).abs().max().item() for g, w in zip(got_t, want_t))
        with kernel_backend("triton"):
            g1 = torch.autograd.grad(sum(g.sum() for g in got_t), xs)
        g2 = torch.autograd.grad(sum(w.sum() for w in want_t), xs)
        bwd = max((a - b).abs().max().item() for a, b in zip(g1, g2))
        out[name] = (fwd, bwd)
        print(f"  {name:24s} forward {fwd:.2e}  backward {bwd:.2e}", flush=True)
    return out


def main() -> None:
    if HAS_CUDA and triton_available():
        gpu_table()
        return
    print("bench_kernels_gpu needs a CUDA GPU (and triton) for bandwidth numbers; none found.")
    if not triton_available():
        print("triton is not installed: nothing to check")
        sys.exit(0)
    print("Correctness instead: Triton kernels under TRITON_INTERPRET=1 vs torch references (max abs diff):")
    interpreter_check()


if __name__ == "__main__":
    main()
