"""Checkpoints keep each node's module stack (the capture's ``nn_module_stack``: module paths and class names),
read as hostile data: a malformed, over-long or non-identifier entry is refused naming the node; checkpoints
without stacks (written before they were stored) still load, their nodes without one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_gpt, rehash_manifest

from fxforge import ForgeGraph
from fxforge.graph.checkpoint_values import check_module_stack
from fxforge.graph.targets import CheckpointError


@pytest.fixture(scope="module")
def gpt() -> ForgeGraph:
    return ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8))).eval()


@pytest.fixture(scope="module")
def saved(gpt: ForgeGraph, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo GPT's checkpoint, written once; tests edit copies."""
    return gpt.export(tmp_path_factory.mktemp("gpt") / "c")


def _innermost(mg: ForgeGraph) -> dict[str, tuple[str, str]]:
    """Node name -> (innermost module path, its class name) of every node with a stack."""
    out = {}
    for node in mg.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, typ = list(stack.values())[-1]
            out[node.name] = (path, typ if isinstance(typ, str) else typ.__name__)
    return out


def _edit(path: Path, edit: Any) -> None:
    doc = json.loads((path / "graph.json").read_text())
    edit(doc["nodes"])
    (path / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(path)


def test_module_stacks_round_trip(gpt: ForgeGraph, saved: Path) -> None:
    path = saved
    stored = {n["name"]: n.get("module_stack") for n in json.loads((path / "graph.json").read_text())["nodes"]}
    assert stored["blocks_0_mixer_c_attn"] == [["blocks.0", "Block"], ["blocks.0.mixer", "CausalSelfAttention"],
                                               ["blocks.0.mixer.c_attn", "Linear"]]
    assert stored["idx"] is None  # the input belongs to no module: nothing stored
    back = ForgeGraph.from_checkpoint(path)
    assert _innermost(back) == _innermost(gpt) and len(_innermost(gpt)) > 100
    assert all(typ.isidentifier() for _, typ in _innermost(back).values())


def test_checkpoint_without_stacks_still_loads(gpt: ForgeGraph, saved: Path, tmp_path: Path) -> None:
    path = Path(shutil.copytree(saved, tmp_path / "old"))
    _edit(path, lambda nodes: [n.pop("module_stack", None) for n in nodes])
    back = ForgeGraph.from_checkpoint(path)
    assert not any("nn_module_stack" in n.meta for n in back.nodes)
    torch.testing.assert_close(back(gpt.example_inputs.args[0]), gpt(gpt.example_inputs.args[0]))


HOSTILE = [
    ([["blocks.</script><img src=x>", "Linear"]], "module/attribute path"),
    ([["blocks.0\"'", "Linear"]], "module/attribute path"),
    ([["blocks.é", "Linear"]], "module/attribute path"),
    ([["blocks.__class__", "Linear"]], "module/attribute path"),
    ([["blocks..0", "Linear"]], "module/attribute path"),
    ([[5, "Linear"]], "module/attribute path"),
    ([["blocks." + "a" * 2000, "Linear"]], "characters"),
    ([["blocks", "</script>"]], "class name"),
    ([["blocks", "Lin\u2028ear"]], "class name"),
    ([["blocks", "Liné"]], "class name"),
    ([["blocks", None]], "class name"),
    ([["blocks", "L" * 500]], "class name"),
    ([["blocks"]], "pairs"),
    ([["blocks", "Block", "x"]], "pairs"),
    ("blocks", "list"),
    ({"blocks": "Linear"}, "list"),
    ([["blocks", "ModuleList"]] * 1000, "at most"),
]


@pytest.mark.parametrize(("stack", "message"), HOSTILE, ids=[f"{k}-{m}" for k, (_, m) in enumerate(HOSTILE)])
def test_hostile_module_stacks_are_refused(stack: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=f"node 'n': module stack.*{message}") as info:
        check_module_stack(stack, "node 'n'")
    assert len(str(info.value)) < 400  # a hostile value is shown as its repr, cut short, as other fields are


@pytest.mark.parametrize("k", [0, 5, 6, 7])  # </script> path, non-string path, over-long path, </script> class
def test_loader_refuses_a_hostile_stack_naming_the_node(saved: Path, tmp_path: Path, k: int) -> None:
    path = Path(shutil.copytree(saved, tmp_path / "c"))
    stack, message = HOSTILE[k]

    def edit(nodes: list[dict[str, Any]]) -> None:
        next(n for n in nodes if n["name"] == "blocks_0_mixer_c_attn")["module_stack"] = stack

    _edit(path, edit)
    with pytest.raises(CheckpointError, match=f"graph.json: node 'blocks_0_mixer_c_attn'.*module stack.*{message}"):
        ForgeGraph.from_checkpoint(path)


def test_unsavable_stack_entries_are_left_out(gpt: ForgeGraph, tmp_path: Path) -> None:
    """A live stack whose paths a checkpoint cannot name (torch's ``slice(None, 2, None)`` of a sliced
    ModuleList, a hostile name) is not stored: that node's module is inferred after loading, as before."""
    mg = gpt.copy()
    node = next(n for n in mg.nodes if n.name == "blocks_0_mixer_c_attn")
    node.meta["nn_module_stack"] = {"k": ("blocks.slice(None, 2, None).0", "Block"), "q": ("blocks.</script>", "X")}
    path = mg.export(tmp_path / "c")
    stored = {n["name"]: n.get("module_stack") for n in json.loads((path / "graph.json").read_text())["nodes"]}
    assert stored["blocks_0_mixer_c_attn"] is None and stored["blocks_0_mixer_c_proj"] is not None
    back = {n.name: n for n in ForgeGraph.from_checkpoint(path).nodes}
    assert "nn_module_stack" not in back["blocks_0_mixer_c_attn"].meta
