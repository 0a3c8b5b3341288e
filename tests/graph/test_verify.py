"""verify_checkpoint: every check passes on a fresh export and the outputs check catches changed weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
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


def test_verify_prints_the_manifest_digest_and_checks_a_pinned_one(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The digest `fxforge verify` prints is the manifest's SHA-256; pinned, it refuses a re-hashed forgery."""
    from fxforge.cli.app import main

    path = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8))).eval().export(tmp_path / "gpt")
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    report, _ = verify_checkpoint(path)
    assert report.ok and f"manifest SHA-256 {digest}" in report.checks[0].detail
    assert main(["verify", str(path), "--expected-sha256", digest.upper()]) == 0
    assert "matches the expected digest" in capsys.readouterr().out

    weights = safetensors.torch.load_file(path / "weights.safetensors")
    a, b = "blocks.0.mlp.c_fc.weight", "blocks.1.mlp.c_fc.weight"
    weights[a], weights[b] = weights[b], weights[a]
    safetensors.torch.save_file(weights, path / "weights.safetensors", metadata={"format": "pt"})
    rehash_manifest(path)
    assert main(["verify", str(path), "--expected-sha256", digest]) == 1
    err = capsys.readouterr().err
    assert f"manifest.json: SHA-256 {hashlib.sha256((path / 'manifest.json').read_bytes()).hexdigest()} is not " \
           f"the expected {digest}" in err and err.count("\n") == 1
    report, back = verify_checkpoint(path, expected_sha256=digest)
    assert not report.ok and back is None and report.checks[0].name == "load"
