"""examples/hardware_digits.py: the digits MLP's width search, the chosen point's estimate and its integer
reference (unmarked: no simulation), and with --quick end to end through Verilator (slow: one ~60 s build)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from fxforge.examples.hardware_digits import choose, frac_for


def test_fraction_width_covers_the_range_and_choice_rule() -> None:
    assert frac_for(8, 1.0) == 7 and frac_for(8, 0.3) == 8 and frac_for(4, 6.5) == 0 and frac_for(4, 20.0) == -2
    rows = [{"trial": 0, "accuracy": 0.98, "weight_memory_bits": 9000, "multiplier_bits": 2000},
            {"trial": 1, "accuracy": 0.975, "weight_memory_bits": 7000, "multiplier_bits": 1500},
            {"trial": 2, "accuracy": 0.96, "weight_memory_bits": 4000, "multiplier_bits": 600}]
    assert choose(rows)["trial"] == 1 and choose(rows, tolerance=0.03)["trial"] == 2


def test_search_and_estimate_without_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.examples.hardware_digits import main

    assert main(["--quick", "--no-sim", "--trials", "4", "--run-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    # the integer reference equals the quantized model (asserted inside main); the chosen point is on the front
    assert summary["quantized_accuracy"] > 0.5 and summary["float_accuracy"] > 0.9
    assert summary["estimate"]["multipliers"] == 8 * 4 + 4 * 2  # the example's parallelism
    assert f"{summary['estimate']['weight_memory_bits']} weight memory bits" in text
    assert re.search(r"latency \d+ cycles = [0-9.]+ us at 200 MHz", text) and "RTL" not in text


@pytest.mark.slow  # one Verilator build (~60 s on a loaded box, cached per source hash) and 360 vectors simulated
def test_quick_example_rtl_accuracy_equals_quantized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.examples.hardware_digits import main

    builds = os.environ.get("FXFORGE_HW_BUILD_ROOT") or str(Path(tempfile.gettempdir()) / "fxforge-hw-builds")
    assert main(["--quick", "--run-dir", str(tmp_path), "--build-root", builds]) == 0
    text = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rtl_accuracy"] == summary["quantized_accuracy"] > 0.5
    assert summary["rtl_latency_cycles"] == summary["estimate"]["latency_cycles"]
    m = re.search(r"RTL \(Verilator\) test accuracy ([0-9.]+) = quantized model ([0-9.]+): 360 class indices "
                  r"bit-exact", text)
    assert m is not None and m.group(1) == m.group(2), text
    assert re.search(r"estimate at parallelism .*: 40 multipliers \(\d+ multiplier bits\), \d+ weight memory bits",
                     text)
    assert (tmp_path / "rtl" / "digits_mlp.sv").exists()
