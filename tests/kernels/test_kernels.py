"""Every fused op: the Triton kernel (under TRITON_INTERPRET=1, tiny shapes) against its torch reference,
forward and backward, at non-power-of-2 widths, masked rows and fp16/bf16; fake impls under torch.export."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from fxforge import kernels
from fxforge.kernels import activation, layernorm
from fxforge.kernels import afno as afno_mlp
from fxforge.kernels import row_softmax as softmax
from fxforge.kernels.dispatch import kernel_backend, next_power_of_2, use_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
LOW = (torch.float16, torch.bfloat16)


def _leaves(n: int, *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def check_op(fn: Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor], leaves: list[torch.Tensor],
             consts: tuple[object, ...] = (), tol: float = 1e-5) -> tuple[float, float]:
    """fn vs ref on the same leaves: outputs and every leaf's gradient agree within ``tol`` (relative to scale)."""
    assert use_triton(leaves[0]), "the Triton path must run under the interpreter"
    out, want = fn(*leaves, *consts), ref(*leaves, *consts)
    outs, wants = (out, want) if isinstance(out, tuple) else ((out,), (want,))
    fwd = max((o.float() - w.float()).abs().max().item() for o, w in zip(outs, wants))
    for o, w in zip(outs, wants):
        assert o.dtype == w.dtype and o.shape == w.shape
        torch.testing.assert_close(o.float(), w.float(), atol=tol, rtol=tol, equal_nan=True)
    gens = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(o.dtype) for o in outs]
    got = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, gens)), leaves, allow_unused=True)
    exp = torch.autograd.grad(sum((w * g).sum() for w, g in zip(wants, gens)), leaves, allow_unused=True)
    bwd = 0.0
    for a, b in zip(got, exp):
        assert (a is None) == (b is None)
        if a is not None:
            scale = max(1.0, b.float().abs().max().item())
            torch.testing.assert_close(a.float(), b.float(), atol=tol * scale, rtol=tol)
            bwd = max(bwd, (a.float() - b.float()).abs().max().item())
    return fwd, bwd


@pytest.mark.parametrize("n", [1, 7, 13, 64])
def test_block_size_is_next_power_of_two(n: int) -> None:
    b = next_power_of_2(n)
    assert b >= n and b & (b - 1) == 0 and b // 2 < max(n, 1)


@pytest.mark.parametrize("width", [7, 13, 32])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_softmax(width: int, dtype: torch.dtype) -> None:
    check_op(softmax.softmax, softmax.softmax_reference, _leaves(width, (3, 5, width), dtype=dtype), tol=TOL[dtype])


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 11), (2, 1, 6, 11), (11,)])
def test_scaled_masked_softmax_masked_rows(mask_shape: tuple[int, ...]) -> None:
    (x,) = _leaves(1, (2, 3, 6, 11))
    mask = torch.zeros(mask_shape)
    mask[..., 8:] = float("-inf")                   # padded keys
    if len(mask_shape) == 4:
        mask[0, ..., :] = torch.finfo(torch.float32).min  # a fully masked sample (HF's additive mask)
    check_op(softmax.scaled_masked_softmax, softmax.scaled_masked_softmax_reference, [x], (mask, 0.35))


def test_fully_neg_inf_row_is_nan_like_torch() -> None:
    x = torch.randn(2, 5)
    mask = torch.zeros(2, 5)
    mask[1] = float("-inf")
    got = softmax.scaled_masked_softmax(x, mask, 1.0)
    torch.testing.assert_close(got, torch.softmax(x + mask, -1), equal_nan=True)
    assert got[1].isnan().all()


def test_mask_gradient_and_no_mask() -> None:
    x, bias = _leaves(3, (2, 2, 4, 9), (1, 2, 4, 9))  # a learned additive bias (ALiBi-like) gets its gradient
    check_op(softmax.scaled_masked_softmax, softmax.scaled_masked_softmax_reference, [x, bias], (0.5,))
    check_op(lambda t: softmax.scaled_masked_softmax(t, None, 2.0),
             lambda t: softmax.scaled_masked_softmax_reference(t, None, 2.0), _leaves(4, (3, 10)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scaled_masked_softmax_low_precision(dtype: torch.dtype) -> None:
    (x,) = _leaves(5, (2, 2, 3, 9), dtype=dtype)
    mask = torch.zeros(2, 1, 1, 9, dtype=dtype)
    mask[1, ..., 5:] = torch.finfo(dtype).min
    check_op(softmax.scaled_masked_softmax, softmax.scaled_masked_softmax_reference, [x], (mask, 0.5), TOL[dtype])


@pytest.mark.parametrize("width", [13, 32])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm(width: int, affine: str) -> None:
    x, w, b = _leaves(width, (3, 4, width), (width,), (width,))
    w_, b_ = (w if affine != "none" else None), (b if affine == "both" else None)
    leaves = [x] + [t for t in (w_, b_) if t is not None]

    def run(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda x, *wb: fn(x, *(list(wb) + [None] * (2 - len(wb))), 1e-5)

    check_op(run(layernorm.layer_norm), run(layernorm.layer_norm_reference), leaves, tol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_add_layer_norm(dtype: torch.dtype) -> None:
    leaves = _leaves(2, (2, 5, 19), (2, 5, 19), (19,), (19,), dtype=dtype)
    check_op(layernorm.add_layer_norm, layernorm.add_layer_norm_reference, leaves, (1e-5,),
             tol=max(2e-5, TOL[dtype]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, *LOW])
def test_bias_gelu(approximate: str, dtype: torch.dtype) -> None:
    leaves = _leaves(3, (3, 7, 23), (23,), dtype=dtype)
    check_op(activation.bias_gelu, activation.bias_gelu_reference, leaves, (approximate,), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_relu(dtype: torch.dtype) -> None:
    check_op(activation.bias_relu, activation.bias_relu_reference, _leaves(4, (5, 37), (37,), dtype=dtype),
             tol=TOL[dtype])


@pytest.mark.parametrize("dims", [(2, 5, 3, 6, 6), (1, 3, 2, 16, 32)])  # broadcast-sum tiles; tl.dot tiles
def test_afno_mlp(dims: tuple[int, int, int, int, int]) -> None:
    b, m, k, i, o = dims
    leaves = _leaves(5, (b, m, k, i, 2), (2, k, i, o), (2, k, o), (2, k, o, i), (2, k, i))
    mode_mask = (torch.arange(m) < m - 1).float()   # the last mode hard-thresholded away
    check_op(afno_mlp.afno_mlp, afno_mlp.afno_mlp_reference, leaves, (mode_mask, 0.01), tol=2e-5)


def test_ops_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="bias"):
        activation.bias_gelu(torch.randn(2, 4), torch.randn(3), "none")
    with pytest.raises(ValueError, match="approximate"):
        activation.bias_gelu(torch.randn(2, 4), torch.randn(4), "fast")
    with pytest.raises(ValueError, match="broadcast"):
        softmax.scaled_masked_softmax(torch.randn(2, 4), torch.randn(3, 4), 1.0)
    with pytest.raises(ValueError, match="must be one of"):
        with kernel_backend("cuda"):  # type: ignore[arg-type]
            pass


def test_reference_backend_is_what_cpu_runs_without_interpreter() -> None:
    x = torch.randn(3, 9)
    with kernel_backend("reference"):
        assert not use_triton(x)
        ref = kernels.softmax(x)
    torch.testing.assert_close(kernels.softmax(x), ref)


class _AllOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12))
        self.b = nn.Parameter(torch.randn(12))
        self.w1 = nn.Parameter(0.2 * torch.randn(2, 1, 6, 6))
        self.b1 = nn.Parameter(0.1 * torch.randn(2, 1, 6))
        self.w2 = nn.Parameter(0.2 * torch.randn(2, 1, 6, 6))
        self.b2 = nn.Parameter(0.1 * torch.randn(2, 1, 6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y, s = torch.ops.fxforge.add_layer_norm(x, x, self.w, self.b, 1e-5)
        y = torch.ops.fxforge.layer_norm(y, self.w, None, 1e-5) + s
        y = torch.ops.fxforge.bias_gelu(y, self.b, "tanh") + torch.ops.fxforge.bias_relu(y, self.b)
        y = torch.ops.fxforge.softmax(y) + torch.ops.fxforge.scaled_masked_softmax(y, mask, 0.5)
        f = torch.ops.fxforge.afno_mlp(y.reshape(2, 3, 1, 6, 2), self.w1, self.b1, self.w2, self.b2,
                                       torch.ones(3), 0.01)
        return f.reshape(y.shape) + y


def test_fake_impls_export_and_match() -> None:
    model = _AllOps()
    x, mask = torch.randn(2, 3, 12), torch.zeros(2, 1, 12)
    with kernel_backend("reference"):
        exported = torch.export.export(model, (x, mask))
        targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
        assert {"fxforge.add_layer_norm.default", "fxforge.afno_mlp.default",
                "fxforge.scaled_masked_softmax.default"} <= targets
        torch.testing.assert_close(exported.module()(x, mask), model(x, mask))
