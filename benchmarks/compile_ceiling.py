"""The best a compiled fp32 artifact (AOTInductor, a fused ONNX graph) can do over eager on this CPU.

A compiler keeps a graph's math: its matrix multiplies and its attention still run, at best at the speed of the
machine's GEMM kernels. What it can remove is the rest (elementwise ops, copies, dispatch). So the ceiling of
``compiled / eager`` is eager's GEMM and attention time over eager's total when eager's GEMMs already run at
the machine's sgemm rate; the profile of one eager run and a large square sgemm measure both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["EagerProfile", "sgemm_gflops", "profile_eager", "GEMM_OPS", "ATTENTION_OPS"]

GEMM_OPS = frozenset({"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"})
ATTENTION_OPS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu",
                           "aten::_scaled_dot_product_attention_math"})


@dataclass(frozen=True)
class EagerProfile:
    """Per-call milliseconds of one eager forward: its GEMMs and attention (self time in a profile) and the whole
    call timed without the profiler (whose per-op cost would inflate the rest); the GEMMs' rate (GFLOP/s from
    the profiler's FLOP count) against the machine's measured sgemm rate."""

    gemm_ms: float
    attention_ms: float
    eager_ms: float
    gemm_gflops: float
    sgemm_gflops: float

    @property
    def other_ms(self) -> float:
        return max(0.0, self.eager_ms - self.gemm_ms - self.attention_ms)

    @property
    def floor_x(self) -> float:
        """compiled / eager if GEMMs and attention kept eager's speed and everything else cost nothing."""
        return (self.gemm_ms + self.attention_ms) / self.eager_ms

    @property
    def peak_floor_x(self) -> float:
        """The same with the GEMMs at the machine's sgemm rate (no compiler does better in fp32)."""
        return (self.gemm_ms * self.gemm_efficiency + self.attention_ms) / self.eager_ms

    @property
    def gemm_efficiency(self) -> float:
        """Eager's GEMM rate over the machine's sgemm rate (near 1: no compiler can make them faster in fp32)."""
        return self.gemm_gflops / self.sgemm_gflops

    def describe(self) -> str:
        return (f"eager {self.eager_ms:.1f} ms: GEMMs {self.gemm_ms:.1f} ms at {self.gemm_gflops:.0f} GFLOP/s "
                f"({self.gemm_efficiency:.0%} of this CPU's measured sgemm {self.sgemm_gflops:.0f}), attention "
                f"{self.attention_ms:.1f} ms, everything else {self.other_ms:.1f} ms. An fp32 artifact running "
                f"everything else for free reaches {self.floor_x:.3f}x eager at eager's GEMM speed, "
                f"{self.peak_floor_x:.3f}x at the sgemm rate")


def sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The best fp32 n x n x n matmul rate of this machine, with torch's threads (GFLOP/s)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def profile_eager(forward: Callable[[], Any], eager_ms: float | None = None, repeats: int = 5,
                  sgemm: float | None = None) -> EagerProfile:
    """Profile ``repeats`` calls of ``forward`` (after two untimed ones) under no_grad; per-call figures. The
    whole call is ``eager_ms`` when the caller timed it (a benchmark's median), else timed here unprofiled."""
    with torch.no_grad():
        for _ in range(2):
            forward()
        if eager_ms is None:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                forward()
                times.append(time.perf_counter() - t)
            eager_ms = statistics.median(times) * 1e3
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            for _ in range(repeats):
                forward()
    gemm = attention = flops = 0.0
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / repeats
        if event.key in GEMM_OPS:
            gemm += ms
            flops += event.flops / repeats
        elif event.key in ATTENTION_OPS:
            attention += ms
    rate = flops / (gemm / 1e3) / 1e9 if gemm > 0 else 0.0
    return EagerProfile(gemm, attention, eager_ms, rate, sgemm if sgemm is not None else sgemm_gflops())
