"""deploy.json is hostile input: every malformed manifest is one DeployError naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxforge.deploy import DeployCheck, DeployError, DeployManifest, ShapeCheck, read_manifest
from fxforge.deploy.manifest import write_manifest


def _manifest() -> DeployManifest:
    shape = ShapeCheck({"input_ids": [1, 16]}, 1e-7, 1e-4, "relative", True)
    return DeployManifest("onnx", "model.onnx", 123, ("input_ids",), ("logits",), {"input_ids": {0: "batch"}},
                          check=DeployCheck("onnxruntime 1.32.0", False, (shape,), True, 1.5))


def test_round_trip(tmp_path: Path) -> None:
    write_manifest(tmp_path, _manifest())
    assert read_manifest(tmp_path) == _manifest()


@pytest.mark.parametrize("text, words", [
    ('{"version": 1', "invalid JSON"),
    ('{"a": 1, "a": 2}', "duplicate"),
    ("[]", "JSON object"),
    ('{"version": 1}', "missing keys"),
])
def test_malformed_manifest_is_a_deploy_error(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "deploy.json").write_text(text)
    with pytest.raises(DeployError, match=words):
        read_manifest(tmp_path)


@pytest.mark.parametrize("key, value, words", [
    ("format", "tflite", "not one of"),
    ("artifact", "../../etc/passwd", "must be 'model.onnx'"),
    ("artifact_bytes", -1, "non-negative integer"),
    ("inputs", ["a b"], "not a valid tensor or axis name"),
    ("quantization", "x\x1b[31m", "printable string"),
    ("dynamic_axes", {"input_ids": {"zero": "batch"}}, "not an axis number"),
])
def test_hostile_values_are_refused(tmp_path: Path, key: str, value: object, words: str) -> None:
    doc = _manifest().to_json()
    doc[key] = value
    (tmp_path / "deploy.json").write_text(json.dumps(doc))
    with pytest.raises(DeployError, match=words):
        read_manifest(tmp_path)


def test_symlinked_manifest_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_manifest(elsewhere, _manifest())
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "deploy.json").symlink_to(elsewhere / "deploy.json")
    with pytest.raises(DeployError, match="symbolic link"):
        read_manifest(tmp_path / "dir")
