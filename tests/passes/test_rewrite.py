"""The rewrite engine: module swaps and graph rewrites leave the metadata a fresh metadata pass would give."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes.rewrite import GraphRewrite, NoMatchError, inject_modules, swap_module


def fresh_common(mg: ForgeGraph) -> dict[str, Any]:
    """Each node's common metadata as the metadata passes compute it afresh on a copy."""
    again = mg.copy()
    again, _ = passes.init_metadata_analysis_pass(again)
    again, _ = passes.add_common_metadata_analysis_pass(again)
    return {n.name: get_meta(n).common.to_json() for n in again.model.graph.nodes}


def current_common(mg: ForgeGraph) -> dict[str, Any]:
    return {n.name: get_meta(n).common.to_json() for n in mg.model.graph.nodes}


def _with_metadata(model: nn.Module, **kw: Any) -> ForgeGraph:
    mg = ForgeGraph(model, **kw)
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.gain = nn.Parameter(torch.full((inner.out_features,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.gain


class _Widen(nn.Module):
    """Changes the result shape: derived metadata must follow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=-1)


def test_module_swap_refreshes_node_metadata(tiny_bert: nn.Module) -> None:
    mg = _with_metadata(tiny_bert, hf_input_names=["input_ids", "attention_mask"])
    done = inject_modules(mg.model, {"name": "classifier"}, None, lambda name, m: _Scaled(m))
    mg.recompile()
    assert [(d.name, d.old_type, d.new_type) for d in done] == [("classifier", "Linear", "_Scaled")]
    meta = get_meta(mg.node("classifier")).common
    assert meta.module_type is not None and meta.module_type.endswith("_Scaled")
    assert "gain" in meta.args and "weight" not in meta.args
    assert current_common(mg) == fresh_common(mg)


def test_swap_that_changes_shapes_derives_new_shapes() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Identity())
    mg = _with_metadata(model, example_inputs=torch.randn(3, 4))
    swap_module(mg.model, "2", _Widen())
    mg.recompile()
    assert get_meta(mg.node("_2")).common.results["data_out_0"].shape == (3, 12)
    assert current_common(mg) == fresh_common(mg)


def test_graph_rewrite_inserts_replaces_and_bypasses() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.1), nn.ReLU())
    mg = _with_metadata(model, example_inputs=torch.randn(2, 4))
    x = torch.randn(5, 4)
    before = mg.eval()(x)
    gm = mg.model
    with GraphRewrite(gm) as rw:
        linear, dropout, relu = (mg.node(n) for n in ("_0", "_1", "_2"))
        rw.bypass(dropout, linear)
        double = rw.call_function(operator.mul, (linear, 2.0), after=linear)
        rw.set_arg(relu, 0, double)
        half = rw.call_module("post", nn.Identity(), (relu,), after=relu)
        rw.redirect_users(relu, half, keep=lambda u: u is half)
    mg.recompile()
    assert rw.erased == 1 and rw.inserted == 2
    assert not hasattr(gm, "1")  # the dropout module nothing calls is gone
    assert torch.allclose(mg(x), 2 * before)
    assert get_meta(double).common.op == "mul"
    assert get_meta(double).common.results["data_out_0"].shape == (2, 6)
    assert current_common(mg) == fresh_common(mg)


def mul_add(x: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """A fused op standing in for a kernel."""
    return x * a + b


def test_replace_pattern_fuses_a_subgraph() -> None:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x * 3.0 + 1.0)

    mg = _with_metadata(Net(), example_inputs=torch.randn(2, 3))
    x = torch.randn(4, 3)
    before = mg(x)
    nodes = [n for n in mg.model.graph.nodes if n.op == "call_function"][:2]  # mul, add
    with GraphRewrite(mg.model) as rw:
        new = rw.replace_pattern(nodes, lambda r, last: r.call_function(
            mul_add, (nodes[0].args[0], 3.0, 1.0), before=last))
    mg.recompile()
    assert torch.allclose(mg(x), before)
    assert [n.op for n in mg.model.graph.nodes].count("call_function") == 2
    assert get_meta(new).common.op == "mul_add"
    assert current_common(mg) == fresh_common(mg)


@pytest.mark.parametrize("names", [["input_ids", "attention_mask"], ["input_ids", "attention_mask", "labels"]])
def test_remove_dropout_metadata_matches_fresh(tiny_bert: nn.Module, names: list[str]) -> None:
    mg = _with_metadata(tiny_bert, hf_input_names=names)
    mg, info = passes.remove_dropout_transform_pass(mg)
    assert info.removed == 6
    assert current_common(mg) == fresh_common(mg)


def test_inject_no_match_lists_candidates(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(NoMatchError, match="Linear \\(14\\)"):
        inject_modules(mg.model, {"name": "nonexistent"}, None, lambda name, m: m)
    with pytest.raises(NoMatchError):
        inject_modules(mg.model, {"type": "linear"}, None, lambda name, m: None)


def test_get_attr_erase_set_args_and_set_module_keep_metadata_fresh() -> None:
    """What passes used to do around the engine (fusion, folding, shrinking) now goes through it."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    mg = _with_metadata(model, example_inputs=torch.randn(2, 4))
    x = torch.randn(5, 4)
    smaller = nn.Linear(6, 2)
    with torch.no_grad():
        expected = smaller(torch.relu(model[0](x))).reshape(5, 1, 2) + 1.0
    gm = mg.model
    relu, last, out = mg.node("_1"), mg.node("_2"), mg.node("output")
    with GraphRewrite(gm) as rw:
        rw.set_module("2", smaller)  # resized: the caller's shapes and parameters follow
        view = rw.call_function(torch.reshape, (last, (5, 3)), after=last)
        rw.set_args(view, (last, (-1, 1, 2)))  # all of a node's arguments at once
        one = rw.get_attr("one", after=view, buffer=torch.ones(()))  # a new constant, registered and read
        total = rw.call_function(operator.add, (view, one), after=one)
        rw.set_arg(out, 0, total)
        dead = rw.get_attr("0.bias", before=relu)
        with pytest.raises(ValueError, match="cannot erase node '_2'"):
            rw.erase(last)
        rw.erase(dead)
    mg.recompile()
    assert rw.inserted == 4 and rw.erased == 1 and dead not in gm.graph.nodes
    assert torch.allclose(mg(x), expected)
    assert get_meta(last).common.results["data_out_0"].shape == (2, 2)
    assert get_meta(total).common.results["data_out_0"].shape == (2, 1, 2)
    assert current_common(mg) == fresh_common(mg)
