"""compile_ceiling: the eager profile splits one forward into GEMMs, attention and the rest, and the ceiling of a
compiled fp32 artifact follows from those figures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxforge.benchmarks.compile_ceiling import EagerProfile, profile_eager, sgemm_gflops


class _Block(nn.Module):
    """Two linears around an attention and a GELU: every category the profile separates."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return F.gelu(self.out(a)) + x


def test_profile_splits_gemm_attention_and_the_rest() -> None:
    block, x = _Block().eval(), torch.randn(4, 32, 64)
    p = profile_eager(lambda: block(x), repeats=3, sgemm=100.0)
    assert p.gemm_ms > 0 and p.attention_ms > 0 and p.eager_ms > 0 and p.other_ms >= 0  # addmm, flash attention
    assert p.floor_x == pytest.approx((p.gemm_ms + p.attention_ms) / p.eager_ms)  # (profiled kernels at tiny
    # shapes can exceed an unprofiled call: no bound on floor_x here; the MiniLM benchmark prints real figures)
    given = profile_eager(lambda: block(x), eager_ms=1e3, repeats=2, sgemm=100.0)  # a benchmark's own median
    assert given.eager_ms == 1e3 and given.other_ms == pytest.approx(1e3 - given.gemm_ms - given.attention_ms)
    flops = 2 * 4 * 32 * 64 * (192 + 64)  # the two linears' multiply-adds, by hand
    assert p.gemm_gflops == pytest.approx(flops / (p.gemm_ms / 1e3) / 1e9, rel=1e-6)
    assert p.gemm_efficiency == pytest.approx(p.gemm_gflops / 100.0)
    assert f"{p.floor_x:.3f}x eager" in p.describe() and "of this CPU's measured sgemm 100" in p.describe()
    assert p.peak_floor_x == pytest.approx((p.gemm_ms * p.gemm_gflops / 100.0 + p.attention_ms) / p.eager_ms)


def test_figures_by_hand_and_a_measured_sgemm_rate() -> None:
    p = EagerProfile(gemm_ms=60.0, attention_ms=10.0, eager_ms=100.0, gemm_gflops=300.0, sgemm_gflops=400.0)
    assert p.other_ms == 30.0 and p.floor_x == pytest.approx(0.7) and p.gemm_efficiency == pytest.approx(0.75)
    assert p.peak_floor_x == pytest.approx((60 * 0.75 + 10) / 100)  # the GEMMs at 400 take 45 ms
    assert sgemm_gflops(n=256, repeats=2) > 0.1
