"""bench_afno_compile's measurement helpers (the compiled runs themselves are too slow for unit tests):
the profiled step split and the hypervisor steal counter."""

from __future__ import annotations

import torch
from conftest import make_gpt

from fxforge.benchmarks.bench_afno_compile import cpu_steal, split_step


def test_split_step_separates_matrix_multiplies_and_ffts_of_an_afno_step() -> None:
    model = make_gpt("afno")
    parts = split_step(model, torch.randint(0, 64, (2, 32)), steps=2)
    assert parts["gemm"] > 0 and parts["fft"] > 0  # the MLP's linears and the FFT convolution
    assert parts["gemm"] + parts["fft"] < parts["total"]
    attn = split_step(make_gpt("attn"), torch.randint(0, 64, (2, 32)), steps=1)
    assert attn["fft"] == 0 and attn["gemm"] > 0


def test_cpu_steal_counts_up() -> None:
    steal, total = cpu_steal()
    sum(i * i for i in range(200_000))  # burn a few jiffies
    steal2, total2 = cpu_steal()
    assert 0 <= steal <= total and total > 0  # Linux (CI): /proc/stat parsed
    assert steal2 >= steal and total2 > total
