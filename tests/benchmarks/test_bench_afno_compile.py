"""bench_afno_compile's measurement helpers (the compiled runs themselves are too slow for unit tests):
the profiled step split and the hypervisor steal counter."""

from __future__ import annotations

from pathlib import Path

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


def test_cpu_steal_reads_the_steal_column_of_the_cpu_line(tmp_path: Path) -> None:
    """/proc/stat's first line is ``cpu user nice system idle iowait irq softirq steal guest guest_nice``: the
    8th number is the steal, the total is the sum; an unreadable or missing file reads as (0, 0)."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 2 30 4000 5 6 7 8 9 10\ncpu0 50 1 15 2000 2 3 3 4 4 5\nintr 12345\n")
    assert cpu_steal(str(stat)) == (8, 100 + 2 + 30 + 4000 + 5 + 6 + 7 + 8 + 9 + 10)
    stat.write_text("cpu  100 2 30 4000\n")  # an old kernel without the steal column
    assert cpu_steal(str(stat)) == (0, 4132)
    stat.write_text("cpu  not numbers\n")
    assert cpu_steal(str(stat)) == (0, 0)
    assert cpu_steal(str(tmp_path / "missing")) == (0, 0)
