"""Shape guards: a captured graph refuses inputs it was not specialised for, clearly, even after a checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, make_agru, make_tiny_bert, rehash_manifest

from fxforge import ForgeGraph
from fxforge.graph.guards import GUARD_NODE, ShapeGuardError
from fxforge.graph.static_dims import input_dims, specialisation_reasons


@pytest.fixture(scope="module")
def agru() -> tuple[torch.nn.Module, ForgeGraph]:
    model = make_agru()
    return model, ForgeGraph(model, torch.randn(2, 12, 8)).eval()


def test_agru_refuses_other_lengths_naming_the_unrolled_loop(agru: tuple[torch.nn.Module, ForgeGraph],
                                                             tmp_path: Path) -> None:
    model, mg = agru
    assert mg.frontend == "export"
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "agru"))
    for graph in (mg, mg.copy(), loaded):
        x = torch.randn(3, 12, 8)  # another batch size: fine
        with torch.no_grad():
            assert (graph(x) - model(x)).abs().max() <= 1e-5
        for length in (20, 5):
            pattern = rf"input 'x' dimension 1 is {length}, .* exactly 12: .*loop over it was unrolled into 12 steps"
            with pytest.raises(ShapeGuardError, match=pattern + ".*re-capture"):
                graph(torch.randn(3, length, 8))
        with pytest.raises(ShapeGuardError, match="input 'x' has 2 dimensions"):
            graph(torch.randn(3, 12))


def test_bert_dynamic_dims_inside_the_range_equal_eager(tmp_path: Path) -> None:
    model = make_tiny_bert()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    assert sum(n.name == GUARD_NODE for n in mg.nodes) == 1
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "bert"))
    for graph in (mg, loaded):
        for batch, seq in ((1, 3), (4, 33), (2, 64)):
            inputs = bert_inputs(labels=False, batch=batch, seq=seq)
            with torch.no_grad():
                assert (graph(**inputs).logits - model(**inputs).logits).abs().max() <= 1e-5
        with pytest.raises(ShapeGuardError, match=r"input 'input_ids' dimension 1 is 65, .*sizes in \[2, 64\]"):
            graph(**bert_inputs(labels=False, seq=65))
        bad = bert_inputs(labels=False, seq=12)
        bad["attention_mask"] = bad["attention_mask"][:, :10]
        with pytest.raises(ShapeGuardError, match="'attention_mask' dimension 1 is 10, .*'input_ids' dimension 1"):
            graph(**bad)


def test_guard_survives_passes_that_clean_up_the_graph(agru: tuple[torch.nn.Module, ForgeGraph]) -> None:
    mg = agru[1].copy()
    mg.model.graph.eliminate_dead_code()  # the guard has no users, but a side effect
    mg.recompile()
    with pytest.raises(ShapeGuardError):
        mg(torch.randn(3, 20, 8))


# -- dimensions torch.export keeps static in a dynamic capture, with the reason ------------------------------

def make_tiny_funnel() -> torch.nn.Module:
    """A random two-block FunnelModel (pooling between blocks) small enough for unit tests. separate_cls=False:
    with the default, the checkpoint's stored-write check refuses Funnel's ``positional_attn *= cls_mask``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.FunnelConfig(d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                       num_decoder_layers=1, vocab_size=100, separate_cls=False)
    return transformers.FunnelModel(config).eval()


@pytest.fixture(scope="module")
def funnel() -> tuple[torch.nn.Module, ForgeGraph]:
    model = make_tiny_funnel()
    return model, ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()


FUNNEL_CAUSE = r"torch.export specialised input_ids dim 1 to 16: the model's code needs its value as a Python int" \
               r".*modeling_funnel.py:\d+ in get_position_embeds `pos = list\(range\(seq_len\)\)`"


def test_funnel_capture_records_the_static_length_and_why(funnel: tuple[torch.nn.Module, ForgeGraph],
                                                          tmp_path: Path) -> None:
    model, mg = funnel
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "funnel"))
    for graph in (mg, loaded):
        dims = input_dims(graph.model)
        assert dims.guarded and [d.split(" ")[0] for d in dims.dynamic] == ["input_ids[0]", "attention_mask[0]"]
        static = {(s.input, s.dim): s for s in dims.static}
        assert set(static) == {("input_ids", 1), ("attention_mask", 1)}
        assert static["input_ids", 1].size == 16 and re.search(FUNNEL_CAUSE, static["input_ids", 1].reason)
        assert "broadcast against a dimension that is already fixed" in static["attention_mask", 1].reason
        inputs = bert_inputs(labels=False, batch=5, seq=16)  # another batch size at the static length: exact
        with torch.no_grad():
            assert torch.equal(graph(**inputs).last_hidden_state, model(**inputs).last_hidden_state)
        with pytest.raises(ShapeGuardError, match=r"'input_ids' dimension 1 is 12, .*exactly 16: " + FUNNEL_CAUSE):
            graph(**bert_inputs(labels=False, seq=12))


def test_raw_export_specialises_funnel_length_too() -> None:
    """Not fxforge's doing: torch.export itself fixes Funnel's length, and says where."""
    kwargs = bert_inputs(labels=False, batch=2, seq=8)
    shapes = {k: {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO} for k in kwargs}
    ep = torch.export.export(make_tiny_funnel(), (), kwargs, dynamic_shapes=shapes, strict=False)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in kwargs]
    assert [tuple(n.meta["val"].shape)[1] for n in placeholders] == [8, 8]
    assert re.search(FUNNEL_CAUSE.replace("16", "8"), specialisation_reasons(placeholders)["input_ids", 1])


def test_bert_keeps_every_input_dim_dynamic() -> None:
    dims = input_dims(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).model)
    assert dims.guarded and dims.static == ()
    assert dims.dynamic == ("input_ids[0]", "input_ids[1] in [2, 64]", "attention_mask[0]",
                            "attention_mask[1] (= input_ids[1])")


def test_agru_feature_dim_is_static_because_of_the_weight(agru: tuple[torch.nn.Module, ForgeGraph]) -> None:
    static = {(s.input, s.dim): s.reason for s in input_dims(agru[1].model).static}
    assert set(static) == {("x", 1), ("x", 2)}
    assert re.search(r"unrolled into 12 steps.*agru.py:\d+ in forward `for t in range\(x.size\(1\)\):`",
                     static["x", 1])
    assert re.search(r"specialised x dim 2 to 8: it meets a fixed-size operand such as a layer's weight",
                     static["x", 2])


def test_checkpoint_from_before_the_reasons_still_loads_and_reports(funnel: tuple[torch.nn.Module, ForgeGraph],
                                                                    tmp_path: Path) -> None:
    """Checkpoints written before the reasons carry the old generic text in the same field: they load, guard
    and report their static dimensions with that text."""
    path = funnel[1].export(tmp_path / "old")
    doc = json.loads((path / "graph.json").read_text())
    old = "capture specialised this dimension to the example's 16 (the model's code depends on its value)"
    text = re.sub(r"torch\.export specialised [^\"]*", old, json.dumps(doc))
    assert text.count(old) == 2
    (path / "graph.json").write_text(text)
    rehash_manifest(path)
    loaded = ForgeGraph.from_checkpoint(path)
    assert [(s.input, s.dim, s.size, s.reason) for s in input_dims(loaded.model).static] == \
        [("input_ids", 1, 16, old), ("attention_mask", 1, 16, old)]
    with pytest.raises(ShapeGuardError, match="exactly 16: capture specialised this dimension"):
        loaded(**bert_inputs(labels=False, seq=12))
