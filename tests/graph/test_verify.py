"""verify_checkpoint: every check passes on a fresh export and the outputs check catches changed weights."""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
from conftest import make_gpt, rehash_manifest

from fxforge import ForgeGraph
from fxforge.graph.verify import verify_checkpoint


def test_verify_passes_then_catches_changed_weights(tmp_path: Path) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    path = mg.eval().export(tmp_path / "gpt")
    report, back = verify_checkpoint(path)
    assert report.ok and back is not None
    assert [c.status for c in report.checks] == ["ok"] * 5

    weights = safetensors.torch.load_file(path / "weights.safetensors")
    name = next(k for k in weights if k.startswith("blocks") and k.endswith("weight") and weights[k].dim() == 2)
    weights[name] = weights[name] * 1.5  # a consistent, re-hashed checkpoint with different numbers
    safetensors.torch.save_file(weights, path / "weights.safetensors", metadata={"format": "pt"})
    rehash_manifest(path)
    report, _ = verify_checkpoint(path)
    assert not report.ok and report.checks[-1].name == "outputs" and report.checks[-1].status == "failed"


def test_training_mode_graph_records_no_outputs_and_says_so(tmp_path: Path) -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    path = mg.train().export(tmp_path / "gpt")
    assert not (path / "reference_outputs.safetensors").exists()
    report, _ = verify_checkpoint(path)
    assert report.ok and report.checks[-1].status == "skipped" and "training mode" in report.checks[-1].detail
