"""Hostile packed records: a checkpoint cannot pick a codec outside the table, feed it parameters it refuses,
hand it parts of another dtype, shape or size, or claim more elements than its bytes hold -- every one is
refused with CheckpointError before anything is decoded or allocated (issue 28; the guarantees of issue 8)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from security_helpers import edit_json, fresh_copy, remanifest, rewrite, tiny_graph

from fxforge import CheckpointError, ForgeGraph, passes

W = "fc.weight"  # Linear(4, 8): a (8, 4) weight, 32 int4 codes in 16 bytes
CODES = f"{W}:codes"
INT4 = {"name": "integer", "weight_width": 4, "weight_frac_width": 3, "bias_width": 4, "bias_frac_width": 3}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mg, _ = passes.quantize_transform_pass(tiny_graph("fx"), {"by": "type", "linear": {"config": INT4}})
    return mg.export(tmp_path_factory.mktemp("packed") / "ckpt")


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(pristine, tmp_path)


def _entry(doc: dict[str, Any], name: str = W) -> dict[str, Any]:
    return next(e for e in doc["tensors"] if e["name"] == name)


def _edit_record(ckpt: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    edit_json(ckpt, "graph.json", lambda doc: edit(_entry(doc)))


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load((ckpt / "weights.safetensors").read_bytes())


def _store(ckpt: Path, weights: dict[str, torch.Tensor]) -> None:
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))


def _refused(ckpt: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        ForgeGraph.from_checkpoint(ckpt)


def test_pristine_record_is_packed_and_loads(pristine: Path) -> None:
    doc = json.loads((pristine / "graph.json").read_text())
    assert _entry(doc)["packed"]["codec"] == "int" and _entry(doc)["packed"]["parts"] == {"codes": CODES}
    assert _weights(pristine)[CODES].dtype == torch.uint8 and W not in _weights(pristine)
    ForgeGraph.from_checkpoint(pristine)


@pytest.mark.parametrize("name", ["no_such_codec", "INT", "", "int\x00", "__class__"])
def test_unknown_codec_is_refused(ckpt: Path, name: str) -> None:
    _edit_record(ckpt, lambda e: e["packed"].update(codec=name))
    _refused(ckpt, "unknown packed-tensor codec")


@pytest.mark.parametrize("name", [5, None, True, ["int"], {"$": "node", "name": "int"}, 1.5])
def test_codec_name_that_is_not_a_string_is_refused(ckpt: Path, name: Any) -> None:
    _edit_record(ckpt, lambda e: e["packed"].update(codec=name))
    _refused(ckpt, "unknown packed-tensor codec")


@pytest.mark.parametrize("params, match", [
    ({"width": 99}, "refuses params"),
    ({"width": 1}, "refuses params"),
    ({"width": "4"}, "refuses params"),
    ({"mode": "exec"}, "refuses params"),
    ({"frac_width": 10**6}, "refuses params"),
    ({"frac_width": 10**30}, "JSON scalar"),
    ({"width": {"$": "tuple", "items": [4]}}, "JSON scalar"),
    ({"width": [4]}, "JSON scalar"),
    ({"extra": 1}, "refuses params"),
    ({"flatten_from": 7}, "refuses params"),
])
def test_params_out_of_range_or_of_the_wrong_type_are_refused(ckpt: Path, params: dict[str, Any], match: str) -> None:
    _edit_record(ckpt, lambda e: e["packed"]["params"].update(params))
    _refused(ckpt, match)


def test_params_that_are_not_an_object_are_refused(ckpt: Path) -> None:
    _edit_record(ckpt, lambda e: e["packed"].update(params=[["width", 4]]))
    _refused(ckpt, "params must be a JSON object")


@pytest.mark.parametrize("part, match", [
    (lambda t: t.view(torch.int8), r"is \(16,\) torch.int8; codec 'int' needs \(16,\) torch.uint8"),
    (lambda t: t[:-1], r"is \(15,\) torch.uint8; codec 'int' needs \(16,\)"),
    (lambda t: torch.cat([t, t]), r"is \(32,\) torch.uint8; codec 'int' needs \(16,\)"),
    (lambda t: t.reshape(4, 4), r"is \(4, 4\) torch.uint8; codec 'int' needs \(16,\)"),
    (lambda t: t.to(torch.float32), r"torch.float32; codec 'int' needs \(16,\) torch.uint8"),
])
def test_part_of_the_wrong_dtype_shape_or_byte_count_is_refused(ckpt: Path, part: Callable[[torch.Tensor],
                                                                torch.Tensor], match: str) -> None:
    weights = _weights(ckpt)
    weights[CODES] = part(weights[CODES]).contiguous()
    _store(ckpt, weights)
    _refused(ckpt, match)


def test_missing_part_is_refused(ckpt: Path) -> None:
    weights = _weights(ckpt)
    del weights[CODES]
    _store(ckpt, weights)
    _refused(ckpt, f"part '{CODES}' is missing")


def test_a_float_copy_beside_the_parts_is_refused(ckpt: Path) -> None:
    weights = _weights(ckpt)
    weights[W] = torch.zeros(8, 4)
    _store(ckpt, weights)
    _refused(ckpt, "holds tensors graph.json does not mention")


@pytest.mark.parametrize("parts", [{"codes": "out.weight:codes"}, {"codes": CODES, "scale": f"{W}:scale"},
                                   {}, {"__init__": f"{W}:__init__"}, ["codes"], {"codes": 3}])
def test_parts_must_name_exactly_the_codec_parts_under_derived_keys(ckpt: Path, parts: Any) -> None:
    _edit_record(ckpt, lambda e: e["packed"].update(parts=parts))
    _refused(ckpt, "parts must map exactly")


@pytest.mark.parametrize("edit, match", [
    (lambda e: e.update(dtype="float64"), "a packed tensor is float32"),
    (lambda e: e.update(dim_order=[1, 0]), "a packed tensor is float32"),
    (lambda e: e["packed"].update(shape=[8, 4]), "exactly codec, params, parts"),
    (lambda e: e.update(packed="int"), "exactly codec, params, parts"),
    (lambda e: e.update(shape=[2**20, 2**20]), r"shape \[1048576, 1048576\], its module declares \[8, 4\]"),
    (lambda e: e.update(shape=[10**30]), "list of at most 64 integers"),
    (lambda e: e.update(shape=[2**30, 2**30]), "claims 2\\^48 elements or more"),
])
def test_malformed_records_are_refused(ckpt: Path, edit: Callable[[dict[str, Any]], None], match: str) -> None:
    _edit_record(ckpt, edit)
    _refused(ckpt, match)


def test_packed_record_on_an_alias_is_refused(ckpt: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        _entry(doc, "out.weight")["alias_of"] = "fc.bias"
        _entry(doc, "out.weight")["packed"] = _entry(doc)["packed"]
    edit_json(ckpt, "graph.json", edit)
    _refused(ckpt, "cannot be aliases")


def test_packed_record_in_an_older_schema_is_refused(ckpt: Path) -> None:
    edit_json(ckpt, "graph.json", lambda doc: doc.update(schema_version=3))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["schema_version"] = 3
    remanifest(ckpt, manifest)
    _refused(ckpt, "packed records need schema 4")


_CLAIM = """
import resource, sys
from fxforge import CheckpointError, ForgeGraph
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    ForgeGraph.from_checkpoint(sys.argv[1])
except CheckpointError as exc:
    print("refused:", exc)
print("grew_kb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_shape_claiming_more_elements_than_the_bytes_is_refused_before_allocation(ckpt: Path) -> None:
    """The record and the module's config both claim a (8192, 16384) weight (512 MB decoded) over 16 stored
    bytes: refused by the parts check, and the loader's memory stays small."""
    def edit(doc: dict[str, Any]) -> None:
        _entry(doc)["shape"] = [8192, 16384]
        module = next(m for m in doc["modules"] if m["path"] == "fc")
        module["config"].update(in_features=16384, out_features=8192)
    edit_json(ckpt, "graph.json", edit)
    proc = subprocess.run([sys.executable, "-c", _CLAIM, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"part '{CODES}' is (16,) torch.uint8; codec 'int' needs (67108864,) torch.uint8" in proc.stdout
    grew_kb = int(proc.stdout.split("grew_kb")[-1])
    assert grew_kb < 64 * 1024, proc.stdout  # 512 MB would have been decoded
