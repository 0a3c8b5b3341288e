"""Each red-team attack on graph checkpoints (issue 8), as an attacker who recomputes the manifest."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.utils._pytree as pytree
from security_helpers import edit_json, export_ckpt, fresh_copy, remanifest, rewrite, tiny_graph  # noqa: F401

from fxforge import CheckpointError, ForgeGraph
from fxforge.graph.atomic import MAX_JSON_DEPTH
from fxforge.graph.checkpoint import CHECKPOINT_SCHEMA_VERSION

INJECTED = ("x':x}}), self._in_spec)\n__import__('os').system('touch {canary}')\n"
            "def _f(self, x):\n    x, = fx_pytree.tree_flatten_spec(([], {{'x")


@pytest.fixture
def ckpt(export_ckpt: Path, tmp_path: Path) -> Path:  # noqa: F811 (pytest fixture)
    return fresh_copy(export_ckpt, tmp_path)


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


def _load_refused(path: Path, match: str) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as err:
        ForgeGraph.from_checkpoint(path)
    return err.value


def _to_schema_1(path: Path, in_spec: Any, out_spec: Any = None) -> None:
    """Rewrite a checkpoint as fxforge schema 1 wrote it (torch treespec_dumps JSON in codegen)."""
    def edit(g: dict[str, Any]) -> None:
        g["schema_version"] = 1
        g["codegen"]["in_spec"], g["codegen"]["out_spec"] = in_spec, out_spec
    edit_json(path, "graph.json", edit)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = 1
    remanifest(path, manifest)


def _v1(spec: pytree.TreeSpec) -> Any:
    return json.loads(pytree.treespec_dumps(spec))


# 1. code in a dict key of the input structure ------------------------------------------------------------
def test_dict_key_in_input_structure_never_reaches_generated_code(ckpt: Path, canary: Path) -> None:
    edit_json(ckpt, "graph.json", lambda g: g["codegen"]["in_spec"]["tuple"][1]["dict"][0].__setitem__(
        0, INJECTED.format(canary=canary)))
    _load_refused(ckpt, "keys must be 1 distinct identifiers")
    assert not canary.exists()


def test_schema_1_injection_refused_and_honest_schema_1_loads(ckpt: Path, tmp_path: Path, canary: Path) -> None:
    honest = pytree.tree_structure(((), {"x": 0}))
    old = fresh_copy(ckpt, tmp_path, "old")
    _to_schema_1(old, _v1(honest), _v1(pytree.tree_structure(0)))
    back = ForgeGraph.from_checkpoint(old)
    x = torch.randn(3, 4)
    assert torch.equal(back(x=x), tiny_graph("export")(x=x))
    evil = _v1(honest)
    evil[1]["children_spec"][1]["context"] = json.dumps([INJECTED.format(canary=canary)])
    _to_schema_1(ckpt, evil)
    _load_refused(ckpt, "keys must be")
    assert not canary.exists()


def test_identifier_checks_reject_a_trailing_newline(ckpt: Path) -> None:
    edit_json(ckpt, "graph.json", lambda g: g["codegen"]["in_spec"]["tuple"][1]["dict"][0].__setitem__(0, "x\n"))
    _load_refused(ckpt, "identifiers")


# 2. module import through pytree specs -------------------------------------------------------------------
def _plant(tmp_path: Path, name: str, canary: Path) -> None:
    (tmp_path / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(canary)!r}).touch()\n")


@pytest.mark.parametrize("kind", ["defaultdict", "enum", "transformers_prefix"])
def test_structure_types_never_import(ckpt: Path, tmp_path: Path, canary: Path, kind: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _plant(tmp_path, "evil_planted", canary)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    leaf = {"type": None, "context": None, "children_spec": []}
    node = {
        "defaultdict": {"type": "collections.defaultdict", "context": json.dumps(
            {"default_factory_module": "evil_planted", "default_factory_name": "f", "dict_context": ["x"]}),
            "children_spec": [leaf]},
        "enum": {"type": "builtins.dict", "context": json.dumps([{"__enum__": True, "fqn": "evil_planted:X"}]),
                 "children_spec": [leaf]},
        "transformers_prefix": {"type": "transformers.evil_planted.Out", "context": json.dumps(["x"]),
                                "children_spec": [leaf]},
    }[kind]
    _to_schema_1(ckpt, [1, {"type": "builtins.tuple", "context": "null", "children_spec": [
        {"type": "builtins.tuple", "context": "null", "children_spec": []}, node]}])
    _load_refused(ckpt, "schema-1|keys must be|pytree type")
    assert not canary.exists() and "evil_planted" not in sys.modules
    assert not any(m.endswith("evil_planted") for m in sys.modules)


# 3. symlinks and sizes -------------------------------------------------------------------------------------
def test_symlinked_file_is_refused_not_read(ckpt: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_bytes((ckpt / "metadata.json").read_bytes())  # same bytes: the hash check alone would pass
    (ckpt / "metadata.json").unlink()
    (ckpt / "metadata.json").symlink_to(secret)
    _load_refused(ckpt, "metadata.json: is a symbolic link")


def test_symlinked_checkpoint_directory_is_refused(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(ckpt)
    _load_refused(tmp_path / "link", "symbolic link")


def test_oversized_file_is_refused_before_reading(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(ckpt / "weights.safetensors", "ab") as f:
        f.write(b"\0" * (8 << 20))
    read: list[int] = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(n) or real(fd, n))
    _load_refused(ckpt, "weights.safetensors: size/SHA-256 does not match")
    assert sum(read) < 1 << 20


# 4. constructor keys escaping the meta device --------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("device", "cpu"), ("dtype", "float64"), ("in_features", 10**12)])
def test_module_config_keys_are_allowlisted(ckpt: Path, key: str, value: Any) -> None:
    edit_json(ckpt, "graph.json", lambda g: g["modules"][0]["config"].__setitem__(key, value))
    _load_refused(ckpt, "not constructor keys|is \\(8, 4\\) torch.float32, its module declares")


# 5. crashes and lax checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["manifest.json", "graph.json", "metadata.json"])
def test_deeply_nested_json_is_a_clean_error(ckpt: Path, name: str) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    if name == "manifest.json":
        (ckpt / name).write_bytes(deep)
    else:
        rewrite(ckpt, name, deep)
    _load_refused(ckpt, f"nested .* deep \\(at most {MAX_JSON_DEPTH}")


@pytest.mark.parametrize("version", [0, -1, CHECKPOINT_SCHEMA_VERSION + 1, str(CHECKPOINT_SCHEMA_VERSION), True,
                                     float(CHECKPOINT_SCHEMA_VERSION), None])
def test_schema_version_is_checked_exactly(ckpt: Path, version: Any) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["schema_version"] = version
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    _load_refused(ckpt, "schema version .* is not supported")


def test_graph_schema_must_match_the_manifest(ckpt: Path) -> None:
    edit_json(ckpt, "graph.json", lambda g: g.__setitem__("schema_version", 0))
    _load_refused(ckpt, f"not an fxforge graph of schema version {CHECKPOINT_SCHEMA_VERSION}")


def test_node_named_self_is_refused(ckpt: Path) -> None:
    def edit(g: dict[str, Any]) -> None:
        g["nodes"][-2]["name"] = "self"
        g["nodes"][-1]["args"] = [{"$": "node", "name": "self"}]
    edit_json(ckpt, "graph.json", edit)
    _load_refused(ckpt, "malformed node")


def test_weight_shape_must_match_its_module(ckpt: Path) -> None:
    weights = safetensors.torch.load((ckpt / "weights.safetensors").read_bytes())
    weights["fc.weight"] = torch.zeros(3, 3)
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))
    _load_refused(ckpt, r"'fc.weight' is \(3, 3\) torch.float32, its module declares \(8, 4\)")


def test_weight_dtype_must_match_its_module(ckpt: Path) -> None:
    weights = safetensors.torch.load((ckpt / "weights.safetensors").read_bytes())
    weights["fc.weight"] = weights["fc.weight"].double()
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))
    _load_refused(ckpt, "float64, its module declares")


def test_duplicate_json_keys_are_refused(ckpt: Path) -> None:
    text = (ckpt / "graph.json").read_text()
    rewrite(ckpt, "graph.json", text.replace('"frontend": "export"', '"frontend": "export", "frontend": "fx"').encode())
    _load_refused(ckpt, "duplicate key 'frontend'")


# 8. process-wide side effects ----------------------------------------------------------------------------
@pytest.mark.parametrize("target,args", [
    ("torch.ops.aten.set_grad_enabled.default", [False]),
    ("torch.ops.aten.manual_seed.default", [0]),
    ("torch.ops.aten._print.default", ["attacker text"]),
    ("torch.ops.aten.warn.default", ["attacker text"]),
    ("torch.Tensor.requires_grad_", [{"$": "node", "name": "w"}, False]),
])
def test_side_effect_ops_are_refused_naming_the_node(ckpt: Path, target: str, args: list[Any]) -> None:
    def edit(g: dict[str, Any]) -> None:
        evil = {"name": "evil", "op": "call_function", "target": target, "args": args, "kwargs": {}}
        getw = {"name": "w", "op": "get_attr", "target": "fc.weight", "args": [], "kwargs": {}}
        g["nodes"][1:1] = [getw, evil]
    edit_json(ckpt, "graph.json", edit)
    grad, printed = torch.is_grad_enabled(), torch.initial_seed()
    _load_refused(ckpt, rf"node 'evil' \(call_function '{target}'\)")
    assert torch.is_grad_enabled() == grad and torch.initial_seed() == printed


@pytest.mark.parametrize("method", ["requires_grad_", "add_", "zero_"])
def test_in_place_methods_on_parameters_are_refused(ckpt: Path, method: str) -> None:
    def edit(g: dict[str, Any]) -> None:
        args = [{"$": "node", "name": "w"}] + ([1.0] if method == "add_" else [])
        g["nodes"][1:1] = [{"name": "w", "op": "get_attr", "target": "fc.weight", "args": [], "kwargs": {}},
                           {"name": "evil", "op": "call_method", "target": method, "args": args, "kwargs": {}}]
    edit_json(ckpt, "graph.json", edit)
    _load_refused(ckpt, "node 'evil'.*(not an allowed Tensor method|writes in place to 'w')")
