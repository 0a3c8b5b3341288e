"""Helpers of the CLI and report tests: the installed console script and a small exported checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

QUANT = {"by": "type", "default": {"config": {"name": None}},
         "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                               "weight_width": 8, "weight_frac_width": 4, "bias_width": 8, "bias_frac_width": 4}}}


def fxforge_script() -> Path:
    """The ``fxforge`` console script pip installed next to this interpreter (``pip install -e .``)."""
    script = Path(sys.executable).parent / "fxforge"
    assert script.is_file(), f"{script} missing: install the package (make venv / pip install -e .) to get the script"
    return script


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real console script; returns the finished process (text stdout/stderr)."""
    env = {**os.environ, "COLUMNS": "100", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(fxforge_script()), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)


def make_checkpoint(path: Path) -> int:
    """Export a quantized tiny BERT (eval mode, so reference outputs are recorded); returns its node count."""
    from fxforge import ForgeGraph, passes
    from fxforge.models.zoo import build

    zoo = build("tiny-bert")
    mg = ForgeGraph(zoo.model, **zoo.capture)
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    mg, _ = passes.quantize_transform_pass(mg, QUANT)
    mg.eval().export(path)
    return sum(1 for _ in mg.nodes)
