"""The compiler pipeline on the zoo: outputs (eval, ≤1e-6 relative) and gradients (≤1e-5) unchanged on
the naive A-GRU (1 and 2 layers, two captures: it is shape-specialised in time), the GPT (attention and
AFNO) and tiny BERT at two input shapes; metadata stays what a fresh pass computes; checkpoints reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.models.agru import AGRUClassifier

aten = torch.ops.aten


def _out(value: Any) -> torch.Tensor:
    return value.logits if hasattr(value, "logits") else value


def _check_same(opt: ForgeGraph, ref: ForgeGraph, inputs: dict[str, Any] | tuple[Any, ...]) -> None:
    """Eval outputs within 1e-6 relative; gradients of every parameter within 1e-5."""
    call = (lambda g: g(**inputs)) if isinstance(inputs, dict) else (lambda g: g(*inputs))
    opt.eval()
    ref.eval()
    with torch.no_grad():
        a, b = _out(call(opt)), _out(call(ref))
    assert (a - b).abs().max() <= 1e-6 * b.abs().max() + 1e-7
    for g in (opt, ref):
        g.model.zero_grad(set_to_none=True)
        _out(call(g)).square().mean().backward()
    ref_params = dict(ref.model.named_parameters())
    for name, p in opt.model.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def _metadata_is_fresh(mg: ForgeGraph) -> None:
    fresh = mg.copy()
    passes.add_common_metadata_analysis_pass(fresh)
    for node, again in zip(mg.model.graph.nodes, fresh.model.graph.nodes):
        assert get_meta(node).common.to_json() == get_meta(again).common.to_json(), node.name


@pytest.mark.parametrize("layers", [1, 2])
def test_agru_optimized_equal_at_two_captures(layers: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AGRUClassifier(input_size=8, hidden_size=16, num_layers=layers).eval()
    for steps, batch in ((5, 4), (7, 3)):
        x = torch.randn(batch, steps, 8)
        captured = ForgeGraph(model, x)
        passes.add_common_metadata_analysis_pass(captured)
        ref = captured.copy()
        mg, info = passes.optimize_graph_pipeline(captured)
        assert info.nodes_after < info.nodes_before
        matmuls = [n for n in mg.model.graph.nodes if n.target == aten.matmul.default]
        # naive: 4 per step and layer; optimized: one recurrent per step, one projection per layer (+ h0)
        assert len(matmuls) <= layers * (steps + 1) + 1
        assert sum(n.target == aten.eye.default for n in mg.model.graph.nodes) == 1
        cse = [s for name, s in info.steps if name == "cse"][0]
        assert cse["by_op"]["eye.default"] == steps * layers - 1
        _check_same(mg, ref, (x,))
        _check_same(mg, ref, (torch.randn(batch + 2, steps, 8),))  # batch is dynamic, time is not
        with torch.no_grad():
            torch.testing.assert_close(mg(x), model(x), rtol=1e-6, atol=1e-6)
        _metadata_is_fresh(mg)
        loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / f"agru{layers}_{steps}"))
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), mg(x), rtol=0, atol=0)


def test_agru_folded_graph_equal_and_reloads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AGRUClassifier(input_size=8, hidden_size=16, num_layers=2).eval()
    x = torch.randn(3, 6, 8)
    mg, info = passes.optimize_graph_pipeline(ForgeGraph(model, x).eval(), fold=True)
    assert info.folded >= 2
    with torch.no_grad():
        torch.testing.assert_close(mg(x), model(x), rtol=1e-6, atol=1e-6)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "folded"))
    assert passes.holds("constants-folded", loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), mg(x), rtol=0, atol=0)


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_gpt_optimized_equal_at_two_shapes(mixer: str, tmp_path: Path) -> None:
    captured = ForgeGraph(make_gpt(mixer), torch.randint(0, 64, (2, 16)))
    passes.add_common_metadata_analysis_pass(captured)
    ref = captured.copy()
    mg, info = passes.optimize_graph_pipeline(captured)
    assert info.nodes_after <= info.nodes_before
    for shape in ((2, 16), (3, 8)):
        _check_same(mg, ref, (torch.randint(0, 64, shape),))
    _metadata_is_fresh(mg)
    idx = torch.randint(0, 64, (2, 16))
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / mixer))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), mg(idx), rtol=0, atol=0)


def test_bert_optimized_equal_at_two_shapes(tmp_path: Path) -> None:
    bert: nn.Module = make_tiny_bert()
    captured = ForgeGraph(bert, hf_input_names=["input_ids", "attention_mask"]).eval()
    passes.add_common_metadata_analysis_pass(captured)
    ref = captured.copy()
    mg, info = passes.optimize_graph_pipeline(captured)
    assert info.nodes_after <= info.nodes_before
    for batch, seq in ((3, 11), (2, 7)):
        _check_same(mg, ref, bert_inputs(batch=batch, seq=seq, labels=False))
    _metadata_is_fresh(mg)
    inputs = bert_inputs(labels=False)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "bert"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, mg(**inputs).logits, rtol=0, atol=0)
