"""Shape guards: a captured graph refuses inputs it was not specialised for, clearly, even after a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, make_agru, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.guards import GUARD_NODE, ShapeGuardError


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
