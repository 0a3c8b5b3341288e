"""deploy.json is hostile input: every malformed manifest is one DeployError naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxforge.deploy import DeployCheck, DeployError, DeployManifest, ShapeCheck, read_manifest
from fxforge.deploy.manifest import AxisRange, write_manifest


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


def _ranged() -> DeployManifest:
    return DeployManifest("pte", "model.pte", 9, ("input_ids",), ("logits",),
                          {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch"}},
                          axis_ranges={"input_ids": {0: AxisRange(1, 8), 1: AxisRange(2, 64)},
                                       "logits": {0: AxisRange(1, 8, "input_ids[0]")}})


def test_ranges_round_trip(tmp_path: Path) -> None:
    write_manifest(tmp_path, _ranged())
    assert read_manifest(tmp_path) == _ranged()
    doc = json.loads((tmp_path / "deploy.json").read_text())
    assert doc["version"] == 2 and doc["axis_ranges"]["logits"] == {"0": {"min": 1, "max": 8,
                                                                         "follows": "input_ids[0]"}}


def test_version_1_manifest_without_ranges_still_reads(tmp_path: Path) -> None:
    doc = _manifest().to_json()
    doc["version"] = 1
    del doc["axis_ranges"]
    (tmp_path / "deploy.json").write_text(json.dumps(doc))
    old = read_manifest(tmp_path)
    assert old.version == 1 and old.axis_ranges == {} and old.dynamic_axes == {"input_ids": {0: "batch"}}
    doc["axis_ranges"] = {}
    (tmp_path / "deploy.json").write_text(json.dumps(doc))
    with pytest.raises(DeployError, match="unknown keys"):  # a version 1 manifest has no ranges
        read_manifest(tmp_path)


@pytest.mark.parametrize("ranges, words", [
    ([], "JSON object"),
    ({"input_ids": {"1": {"min": 2, "max": 64}}}, "not a dynamic axis"),
    ({"attention_mask": {"0": {"min": 1, "max": 8}}}, "not a dynamic axis"),
    ({"input_ids": {"0": {"min": 1}}}, "missing keys"),
    ({"input_ids": {"0": {"min": 1, "max": 8, "extra": 1}}}, "unknown keys"),
    ({"input_ids": {"0": {"min": "1", "max": 8}}}, "non-negative integer"),
    ({"input_ids": {"0": {"min": -1, "max": 8}}}, "non-negative integer"),
    ({"input_ids": {"0": {"min": 9, "max": 8}}}, "below its min"),
    ({"input_ids": {"0": {"min": 1, "max": True}}}, "non-negative integer"),
    ({"input_ids": {"0": {"min": 1, "max": 1 << 60}}}, "non-negative integer"),
    ({"input_ids": {"0": {"min": 1, "max": 8, "follows": "input_ids[0]"}}}, "output's axis only"),
    ({"logits": {"0": {"min": 1, "max": 8, "follows": "labels[0]"}}}, "not a dynamic input axis"),
    ({"logits": {"0": {"min": 1, "max": 8, "follows": "input_ids[0"}}}, "not a dynamic input axis"),
    ({"logits": {"0": {"min": 1, "max": 8, "follows": "input_ids[0]" * 50}}}, "not a dynamic input axis"),
])
def test_hostile_ranges_are_refused(tmp_path: Path, ranges: object, words: str) -> None:
    doc = _manifest().to_json()
    doc["dynamic_axes"] = {"input_ids": {"0": "batch"}, "logits": {"0": "batch"}}
    doc["axis_ranges"] = ranges
    (tmp_path / "deploy.json").write_text(json.dumps(doc))
    with pytest.raises(DeployError, match=words):
        read_manifest(tmp_path)


def test_dynamic_axes_of_an_unknown_tensor_refused(tmp_path: Path) -> None:
    doc = _manifest().to_json()
    doc["dynamic_axes"] = {"pixel_values": {"0": "batch"}}
    (tmp_path / "deploy.json").write_text(json.dumps(doc))
    with pytest.raises(DeployError, match="neither an input nor an output"):
        read_manifest(tmp_path)
