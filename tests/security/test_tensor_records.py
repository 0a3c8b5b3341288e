"""Every stored tensor must have the shape and dtype graph.json records for it (buffers of container modules
included: the zoo GPT's rotary ``cos`` table), and a pinned manifest digest turns the manifest's corruption
check into a forgery check (two same-shape weights swapped with a re-hashed manifest)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from security_helpers import edit_json, export_zoo_gpt, fresh_copy, remanifest, rewrite

from fxforge import CheckpointError, ForgeGraph
from fxforge.models.zoo import build

COS = "blocks.0.mixer.rotary.cos"


@pytest.fixture(scope="module")
def zoo_gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_zoo_gpt(tmp_path_factory, "fx")


@pytest.fixture
def ckpt(zoo_gpt: Path, tmp_path: Path) -> Path:
    return fresh_copy(zoo_gpt, tmp_path)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load((path / "weights.safetensors").read_bytes())


def _store(path: Path, weights: dict[str, torch.Tensor]) -> None:
    rewrite(path, "weights.safetensors", safetensors.torch.save(weights))


@pytest.mark.parametrize("change", ["float64_and_3_rows", "3_rows", "float16"])
def test_container_buffer_must_match_its_record(ckpt: Path, change: str) -> None:
    """The rotary tables live in a plain nn.Module (no config declares them): graph.json's record does."""
    weights = _weights(ckpt)
    cos = weights[COS]
    assert cos.shape[0] == 64 and cos.dtype == torch.float32
    weights[COS] = {"float64_and_3_rows": cos[:3].double(), "3_rows": cos[:3], "float16": cos.half()}[change]
    _store(ckpt, weights)
    got = f"{tuple(weights[COS].shape)} {weights[COS].dtype}"
    with pytest.raises(CheckpointError, match=re.escape(f"weights.safetensors: tensor '{COS}' is {got}; graph.json "
                                                        "records (64, 8) torch.float32")):
        ForgeGraph.from_checkpoint(ckpt)


def test_a_record_must_say_shape_and_dtype(ckpt: Path) -> None:
    def edit(g: dict[str, Any]) -> None:
        entry = next(e for e in g["tensors"] if e["name"] == COS)
        del entry["dtype"]
    edit_json(ckpt, "graph.json", edit)
    with pytest.raises(CheckpointError, match=rf"graph\.json: tensors\[\d+\] \('{COS}'\): shape must be a list of "
                                              "at most 64 non-negative integers and dtype a torch dtype name"):
        ForgeGraph.from_checkpoint(ckpt)


def test_schema_2_checkpoints_without_records_still_load(ckpt: Path, zoo_gpt: Path) -> None:
    """Exported before records existed: loaded (configured modules still check their own tensors)."""
    def edit(g: dict[str, Any]) -> None:
        g["schema_version"] = 2
        for e in g["tensors"]:
            e.pop("shape"), e.pop("dtype")
    edit_json(ckpt, "graph.json", edit)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["schema_version"] = 2
    remanifest(ckpt, manifest)
    tokens = build("gpt").capture["example_inputs"]
    with torch.no_grad():
        old, new = ForgeGraph.from_checkpoint(ckpt), ForgeGraph.from_checkpoint(zoo_gpt)
        torch.testing.assert_close(old(tokens), new(tokens))


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def test_pinned_digest_refuses_swapped_weights(ckpt: Path) -> None:
    pinned = _digest(ckpt)
    assert ForgeGraph.from_checkpoint(ckpt, expected_sha256=pinned).frontend == "fx"
    weights = _weights(ckpt)
    a, b = "blocks.0.mlp.c_fc.weight", "blocks.1.mlp.c_fc.weight"
    weights[a], weights[b] = weights[b], weights[a]
    _store(ckpt, weights)
    ForgeGraph.from_checkpoint(ckpt)  # consistent and re-hashed: the manifest alone cannot tell
    with pytest.raises(CheckpointError, match=rf"manifest\.json: SHA-256 {_digest(ckpt)} is not the expected "
                                              rf"{pinned}"):
        ForgeGraph.from_checkpoint(ckpt, expected_sha256=pinned)


@pytest.mark.parametrize("bad", ["abc", "G" * 64, 5])
def test_pinned_digest_must_be_a_sha256_hex_string(ckpt: Path, bad: Any) -> None:
    with pytest.raises(CheckpointError, match="expected_sha256 must be 64 hexadecimal digits"):
        ForgeGraph.from_checkpoint(ckpt, expected_sha256=bad)
