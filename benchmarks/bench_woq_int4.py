"""The int4 weight-only linear (WeightOnlyInt4Linear: ATen int4 pack, bf16 activations) vs fp32 / bf16 F.linear.

Two shapes the issue names: a decode GEMV (1 x 768 @ 768 x 2048, memory-bound: weights are cycled over
>= 2x the L3 so each call streams them from DRAM) and a prefill-sized GEMM (1024 x 384 @ 384 x 1536,
compute-bound). The ceiling is printed first: weight bytes per call over the measured read bandwidth.
Variants run interleaved (benchmarks/timing.py); medians and their ratio to fp32 F.linear.

    .venv/bin/python -m fxforge.benchmarks.bench_woq_int4 [--quick] [--repeats 31] [--threads N]

On a loaded 2-core machine a 2-thread call can wait a scheduler slice for its sleeping OpenMP worker;
``--threads 1`` shows the kernels.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxforge.benchmarks.bench_woq_int8 import cpu_model, cycling, l3_bytes, read_bandwidth, replicate
from fxforge.benchmarks.timing import interleaved
from fxforge.passes.quantize.woq_modules import WeightOnlyInt4Linear, resident_bytes

SHAPES = [(1, 768, 2048), (1024, 384, 1536)]  # (rows, K, N)


def variants_for(m: int, k: int, n: int, target: int) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    """Timed callables for one shape (each cycling its own weight copies) and each variant's weight bytes."""
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, k, generator=gen)
    codes = torch.randint(-8, 8, (n, k), generator=gen)
    out: dict[str, Callable[[], Any]] = {}
    sizes: dict[str, int] = {}
    for group in (32, 128):
        scale = torch.pow(2.0, torch.randint(-8, -4, (n, k // group), generator=gen).float())
        layer = WeightOnlyInt4Linear.from_codes(codes, scale, group, None)
        sizes[f"int4 g{group}"] = resident_bytes(layer)
        copies = replicate(functools.partial(_clone, layer), sizes[f"int4 g{group}"], target)
        out[f"int4 g{group}"] = cycling(lambda mod: mod(x), copies)
    w32 = layer.dequantized_weight()
    sizes["fp32 F.linear"], sizes["bf16 F.linear"] = n * k * 4, n * k * 2
    out["fp32 F.linear"] = cycling(lambda w: F.linear(x, w), replicate(w32.clone, n * k * 4, target))
    out["bf16 F.linear"] = cycling(lambda w: F.linear(x.bfloat16(), w).float(),
                                   replicate(lambda: w32.bfloat16(), n * k * 2, target))
    return out, sizes


def _clone(layer: WeightOnlyInt4Linear) -> WeightOnlyInt4Linear:
    new = WeightOnlyInt4Linear(layer.in_features, layer.out_features, layer.group_size, False, layer.layout)
    new.weight_int4pack, new.scales_and_zeros = layer.weight_int4pack.clone(), layer.scales_and_zeros.clone()
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="7 repeats, weights cycled over 1x the L3")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 7 if args.quick else args.repeats
    target = l3_bytes() * (1 if args.quick else 2)
    bw = read_bandwidth()
    print(f"{cpu_model()} | torch {torch.__version__} | capability {torch.backends.cpu.get_cpu_capability()} | "
          f"threads {torch.get_num_threads()} | read bandwidth {bw / 1e9:.1f} GB/s | {repeats} interleaved "
          f"repeats, medians")
    with torch.no_grad():
        for m, k, n in SHAPES:
            variants, sizes = variants_for(m, k, n, target)
            floor = {name: sizes[name] / bw * 1e6 for name in variants}
            print(f"\n{m} x {k} @ {k} x {n}: ceiling (weight bytes / bandwidth) "
                  + ", ".join(f"{name} {us:.0f} us" for name, us in floor.items()))
            t = interleaved(variants, repeats, warmup=3)
            for name in variants:
                print(f"  {name:14s} {t.median(name) * 1e6:10.1f} us   {t.pair_ratio(name, 'fp32 F.linear'):6.2f}x fp32"
                      f"   weights {sizes[name] / 1e6:6.2f} MB")


if __name__ == "__main__":
    main()
