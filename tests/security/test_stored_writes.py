"""A loaded graph never changes its own weights: writes to anything that may share storage with a stored
tensor (views, ``getattr(w, "data")``, ``getitem`` of a split, ``out=``, ``inplace``, the ``operator.i*``
family) and module values (``get_attr`` of a submodule, then ``.half()``) are refused at load. Each attack
edits a zoo GPT exported with fxforge's own export and re-hashes the manifest."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
from security_helpers import edit_json, fresh_copy

from fxforge import CheckpointError, ForgeGraph
from fxforge.graph import targets
from fxforge.models.zoo import build


def ref(name: str) -> dict[str, str]:
    return {"$": "node", "name": name}


def node(name: str, op: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"name": name, "op": op, "target": target, "args": list(args), "kwargs": kwargs}


W = node("w", "get_attr", "lm_head.weight")
COS = node("cos", "get_attr", "blocks.0.mixer.rotary.cos")
ALL = {"$": "slice", "items": [None, None, None]}


@pytest.fixture(scope="module")
def zoo_gpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The zoo GPT exported by fxforge, captured by each frontend (fx: Python targets, export: ATen ops)."""
    zm = build("gpt")
    root = tmp_path_factory.mktemp("zoo_gpt")
    return {fe: ForgeGraph(zm.model, frontend=fe, **zm.capture).export(root / fe) for fe in ("fx", "export")}


def _insert(path: Path, nodes: list[dict[str, Any]], modules: list[dict[str, Any]] = ()) -> None:  # type: ignore[assignment]
    """Insert ``nodes`` after the graph's placeholders (and ``modules`` into its module tree)."""
    def edit(g: dict[str, Any]) -> None:
        first = next(i for i, n in enumerate(g["nodes"]) if n["op"] != "placeholder")
        g["nodes"][first:first] = nodes
        g["modules"].extend(modules)
    edit_json(path, "graph.json", edit)


FX_ATTACKS: dict[str, list[dict[str, Any]]] = {
    "setitem": [W, node("evil", "call_function", "operator.setitem", ref("w"), ALL, 0.0)],
    "data_zero": [W, node("d", "call_function", "builtins.getattr", ref("w"), "data"),
                  node("evil", "call_method", "zero_", ref("d"))],
    "transpose_attribute": [W, node("t", "call_function", "builtins.getattr", ref("w"), "T"),
                            node("evil", "call_method", "add_", ref("t"), 1.0)],
    "view_then_narrow": [W, node("v", "call_method", "view", ref("w"), -1),
                         node("n", "call_function", "torch.narrow", ref("v"), 0, 0, 4),
                         node("evil", "call_method", "fill_", ref("n"), 0.0)],
    "split_getitem": [W, node("s", "call_method", "split", ref("w"), 8),
                      node("g", "call_function", "operator.getitem", ref("s"), 0),
                      node("evil", "call_method", "zero_", ref("g"))],
    "detach_copy": [W, node("d", "call_method", "detach", ref("w")),
                    node("z", "call_function", "torch.zeros_like", ref("w")),
                    node("evil", "call_method", "copy_", ref("d"), ref("z"))],
    "eval_dropout_returns_its_input": [W, node("d", "call_function", "torch.nn.functional.dropout", ref("w"),
                                               training=False),
                                       node("evil", "call_method", "mul_", ref("d"), 0.0)],
    "out_keyword": [W, node("evil", "call_function", "torch.mul", ref("w"), 0.0, out=ref("w"))],
    "inplace_keyword": [W, node("evil", "call_function", "torch.nn.functional.relu", ref("w"), inplace=True)],
    "inplace_positional": [W, node("evil", "call_function", "torch.nn.functional.hardtanh", ref("w"), 0.0, 0.0,
                                   True)],
    "tensor_method_as_function": [W, node("evil", "call_function", "torch.Tensor.zero_", ref("w"))],
    "buffer": [COS, node("evil", "call_method", "zero_", ref("cos"))],
    **{f"operator_{op}": [W, node("evil", "call_function", f"operator.{op}", ref("w"), 0.5)]
       for op in ("iadd", "isub", "imul", "itruediv", "ipow")},
}


@pytest.mark.parametrize("attack", sorted(FX_ATTACKS))
def test_writes_to_stored_tensors_are_refused(zoo_gpt: dict[str, Path], tmp_path: Path, attack: str) -> None:
    ckpt = fresh_copy(zoo_gpt["fx"], tmp_path)
    _insert(ckpt, FX_ATTACKS[attack])
    with pytest.raises(CheckpointError, match=r"graph\.json: node 'evil' .*writes in place to '\w+', which may share "
                                              r"storage with the stored tensor '(lm_head\.weight|blocks\.0\.mixer"
                                              r"\.rotary\.cos)'"):
        ForgeGraph.from_checkpoint(ckpt)


def _allowlisted(name: str) -> bool:
    try:
        return targets.resolve_function(name) is not None
    except CheckpointError:
        return False


def test_every_operator_in_place_function_is_refused(zoo_gpt: dict[str, Path], tmp_path: Path) -> None:
    names = [n.strip("_") for n in dir(operator) if n.startswith("__i") and hasattr(operator, "__" + n[3:])]
    allowed = [n for n in names if _allowlisted(f"operator.{n}")]
    assert {"iadd", "imatmul", "ior", "ilshift"} <= set(allowed)
    for name in allowed:
        ckpt = fresh_copy(zoo_gpt["fx"], tmp_path, name)
        _insert(ckpt, [W, node("evil", "call_function", f"operator.{name}", ref("w"), ref("w"))])
        with pytest.raises(CheckpointError, match="node 'evil' .*writes in place to 'w'"):
            ForgeGraph.from_checkpoint(ckpt)


def test_a_module_built_in_place_cannot_be_called_on_a_weight(zoo_gpt: dict[str, Path], tmp_path: Path) -> None:
    ckpt = fresh_copy(zoo_gpt["fx"], tmp_path)
    relu = {"path": "evil_relu", "class": "torch.nn.ReLU", "config": {"inplace": True}}
    _insert(ckpt, [W, node("evil", "call_module", "evil_relu", ref("w"))], [relu])
    with pytest.raises(CheckpointError, match="node 'evil' .*writes in place to 'w'"):
        ForgeGraph.from_checkpoint(ckpt)


@pytest.mark.parametrize("method", ["half", "float", "to"])
def test_module_values_are_refused(zoo_gpt: dict[str, Path], tmp_path: Path, method: str) -> None:
    ckpt = fresh_copy(zoo_gpt["fx"], tmp_path)
    _insert(ckpt, [node("m", "get_attr", "lm_head"), node("evil", "call_method", method, ref("m"))])
    with pytest.raises(CheckpointError, match=r"graph\.json: node 'm' .*get_attr 'lm_head' holds a module"):
        ForgeGraph.from_checkpoint(ckpt)


EXPORT_ATTACKS: dict[str, list[dict[str, Any]]] = {
    "aten_in_place_on_a_buffer": [COS, node("evil", "call_function", "torch.ops.aten.zero_.default", ref("cos"))],
    "aten_view_then_fill": [W, node("v", "call_function", "torch.ops.aten.view.default", ref("w"), [-1]),
                            node("evil", "call_function", "torch.ops.aten.fill_.Scalar", ref("v"), 0.0)],
    "aten_copy_into_a_slice": [W, node("s", "call_function", "torch.ops.aten.slice.Tensor", ref("w"), 0, 0, 2),
                               node("z", "call_function", "torch.ops.aten.zeros_like.default", ref("s")),
                               node("evil", "call_function", "torch.ops.aten.copy_.default", ref("s"), ref("z"))],
    "aten_out_argument": [W, node("z", "call_function", "torch.ops.aten.zeros_like.default", ref("w")),
                          node("evil", "call_function", "torch.ops.aten.mul.out", ref("z"), ref("z"), out=ref("w"))],
}


@pytest.mark.parametrize("attack", sorted(EXPORT_ATTACKS))
def test_aten_writes_to_stored_tensors_are_refused(zoo_gpt: dict[str, Path], tmp_path: Path, attack: str) -> None:
    ckpt = fresh_copy(zoo_gpt["export"], tmp_path)
    _insert(ckpt, EXPORT_ATTACKS[attack])
    with pytest.raises(CheckpointError, match=r"graph\.json: node 'evil' .*writes in place to '\w+'"):
        ForgeGraph.from_checkpoint(ckpt)


def test_writes_to_fresh_values_still_load_and_leave_weights_alone(zoo_gpt: dict[str, Path], tmp_path: Path) -> None:
    """A copy of a weight, or a product computed from one, may be changed in place: nothing stored is touched."""
    ckpt = fresh_copy(zoo_gpt["fx"], tmp_path)
    _insert(ckpt, [W, node("c", "call_method", "clone", ref("w")), node("zc", "call_method", "zero_", ref("c")),
                   node("p", "call_function", "operator.mul", ref("w"), 2.0),
                   node("zp", "call_function", "operator.setitem", ref("p"), ALL, 0.0)])
    back, original = ForgeGraph.from_checkpoint(ckpt), ForgeGraph.from_checkpoint(zoo_gpt["fx"])
    tokens = build("gpt").capture["example_inputs"]
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), original(tokens))
        back(tokens)
    assert torch.equal(back.model.lm_head.weight, original.model.lm_head.weight)
