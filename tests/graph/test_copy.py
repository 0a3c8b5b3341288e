"""ForgeGraph.copy() shares nothing mutable: every pass run on a copy leaves the original as it was."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, bert_metadata_graph, make_tiny_bert
from pass_cases import registered, run_case

from fxforge import ForgeGraph
from fxforge.graph.capture import CACHE_HIT_NOTE
from fxforge.graph.metadata import get_meta, has_meta
from fxforge.passes.quantize import QuantizationRecord, quantize_transform_pass
from fxforge.passes.transform.lora import insert_lora_adapter_transform_pass

DATA = [bert_inputs(labels=False, batch=2, seq=9)]


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    """A tiny BERT graph with full metadata (the state a user copies after the metadata passes)."""
    return bert_metadata_graph()


def snapshot(mg: ForgeGraph) -> dict[str, Any]:
    """Everything a pass could change: outputs, metadata, history, tensors, flags, module types, inputs."""
    with torch.no_grad():
        out = mg(**DATA[0]).logits.clone()
    assert mg.example_inputs is not None
    return {
        "out": out,
        "meta": {n.name: get_meta(n).to_json() if has_meta(n) else None for n in mg.nodes},
        "nodes": [(n.name, n.op, str(n.target)) for n in mg.nodes],
        "history": [r.to_json() for r in mg.history],
        "state": {k: v.detach().clone() for k, v in mg.model.state_dict(keep_vars=True).items()},
        "grad": {k: p.requires_grad for k, p in mg.model.named_parameters()},
        "training": {k: m.training for k, m in mg.model.named_modules()},
        "types": {k: type(m) for k, m in mg.model.named_modules()},
        "inputs": {k: v.clone() for k, v in mg.example_inputs.tensors().items()},
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert torch.equal(before["out"], after["out"])
    for key in ("meta", "nodes", "history", "grad", "training", "types"):
        assert before[key] == after[key], key
    assert before["state"].keys() == after["state"].keys()
    assert all(torch.equal(v, after["state"][k]) for k, v in before["state"].items())
    assert all(torch.equal(v, after["inputs"][k]) for k, v in before["inputs"].items())


def test_copy_shares_no_mutable_state(base: ForgeGraph) -> None:
    cp = base.copy()
    for a, b in zip(base.nodes, cp.nodes):
        assert a.meta["fxforge"] is not b.meta["fxforge"] and a.meta["fxforge"] == b.meta["fxforge"]
        assert get_meta(a).software is not get_meta(b).software
    ids = {id(t) for t in base.model.state_dict(keep_vars=True).values()}
    assert not ids & {id(t) for t in cp.model.state_dict(keep_vars=True).values()}
    ptrs = {t.untyped_storage().data_ptr() for t in base.model.state_dict().values()}
    assert not ptrs & {t.untyped_storage().data_ptr() for t in cp.model.state_dict().values()}
    assert not {id(m) for m in base.model.modules()} & {id(m) for m in cp.model.modules()}
    assert cp.history is not base.history and cp.example_inputs is not base.example_inputs
    assert base.example_inputs is not None and cp.example_inputs is not None
    for k, v in base.example_inputs.tensors().items():
        assert v is not cp.example_inputs.tensors()[k] and torch.equal(v, cp.example_inputs.tensors()[k])
    shared = base.copy(share_weights=True)
    assert all(p is q for p, q in zip(base.model.parameters(), shared.model.parameters()))
    assert get_meta(next(iter(shared.nodes))) is not get_meta(next(iter(base.nodes)))


@pytest.mark.parametrize("name", registered())
def test_every_pass_on_a_copy_leaves_the_original_unchanged(base: ForgeGraph, name: str) -> None:
    before = snapshot(base)
    cp = base.copy()
    cp, _ = run_case(cp, name, DATA)
    with torch.no_grad():
        cp(**DATA[0])  # the result still runs
    assert_same(before, snapshot(base))


def test_lora_on_a_copy_keeps_the_originals_metadata_through_export(base: ForgeGraph, tmp_path: Path) -> None:
    cp = base.copy()
    cp, _ = insert_lora_adapter_transform_pass(cp, {"rank": 2})
    assert get_meta(cp.node("classifier")).common.op == "lora_linear"
    meta = get_meta(base.node("classifier")).common
    assert type(base.model.get_submodule("classifier")) is nn.Linear
    assert (meta.op, meta.module_type) == ("linear", "torch.nn.modules.linear.Linear")
    loaded = ForgeGraph.from_checkpoint(base.export(tmp_path / "base"))
    assert get_meta(loaded.node("classifier")).common.op == "linear"


def test_tutorial_loop_quantizes_a_fresh_copy_per_trial(base: ForgeGraph) -> None:
    # MASE tutorials 6/10: for each trial, quantize a copy of the float graph with another width.
    with torch.no_grad():
        ref = base(**DATA[0]).logits
    errors = {}
    for width in (4, 6, 8, 12, 16):
        trial = base.copy()
        cfg = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": width,
                                                   "data_in_frac_width": width - 3, "weight_width": width,
                                                   "weight_frac_width": width - 1}}}
        trial, info = quantize_transform_pass(trial, cfg)
        assert info["quantized_nodes"] == 14
        rec = get_meta(trial.node("classifier")).software.get(QuantizationRecord)
        assert rec is not None and rec.config["weight_width"] == width
        with torch.no_grad():
            errors[width] = float((trial(**DATA[0]).logits - ref).abs().max())
        assert get_meta(base.node("classifier")).software.get(QuantizationRecord) is None
        assert [r.name for r in base.history] == ["init_metadata_analysis_pass", "add_common_metadata_analysis_pass"]
    assert errors[16] < errors[8] < errors[4]  # each trial really ran at its own width
    with torch.no_grad():
        assert torch.equal(base(**DATA[0]).logits, ref)


def test_capture_of_an_hf_model_emits_no_deprecation_warning() -> None:
    """A fresh capture and a capture-cache hit of an HF model build no new pytree specs either (torch's LeafSpec
    FutureWarning), so quiet() needs no filter for it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = [ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"], cache=cache)
                  for cache in (False, True, True)]
    assert CACHE_HIT_NOTE in graphs[-1].capture_notes
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)] == []


def test_copy_of_an_hf_graph_emits_no_deprecation_warning(bert_graph: ForgeGraph) -> None:
    # torch's LeafSpec is deprecated: copying a graph must not build new pytree specs (they are immutable)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp = bert_graph.copy()
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)] == []
    codegen, new = bert_graph.model.graph._codegen, cp.model.graph._codegen
    assert new is not codegen and new.pytree_info.in_spec is codegen.pytree_info.in_spec
    assert new.pytree_info.orig_args == codegen.pytree_info.orig_args
    assert new.pytree_info.orig_args is not codegen.pytree_info.orig_args
    with torch.no_grad():
        assert torch.equal(cp(**bert_inputs()).logits, bert_graph(**bert_inputs()).logits)
