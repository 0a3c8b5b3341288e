"""activation_checkpoint_transform_pass on attention with dropout: segments holding scaled-dot-product attention
with dropout_p > 0 (HF BERT's attention dropout) are recomputed, and the recomputation replays the forward's RNG
state, so outputs and gradients are bitwise those of the unmodified graph in training mode (tiny BERT and a
MiniLM-shaped BERT, two shapes each); the planner's smallest reachable peak is at least as low as checkpointing
every encoder layer; under torch.compile the regions are traced whole and replay dropout too."""

from __future__ import annotations

import pytest
import torch
from conftest import OpCounts, assert_compiled_step_matches, bert_inputs
from conftest import seeded_training_step as _step

from fxforge import ForgeGraph
from fxforge.graph.inputs import ExampleInputs
from fxforge.graph.modules import ScaledDotProductAttention
from fxforge.models.bert import tiny_bert
from fxforge.passes.memory import activation_checkpoint_transform_pass
from fxforge.passes.memory.activation_checkpoint import MB, checkpoint_regions
from fxforge.passes.memory.checkpoint_plan import graph_costs, plan_checkpoints, plan_of
from fxforge.passes.propagate import flat_inputs

# MiniLM-L6's layer shape (384 wide, 12 heads, 1536 FFN, attention and hidden dropout 0.1) with two layers and a
# small vocabulary; tiny BERT as the other tests use it
MODELS: dict[str, dict[str, int]] = {
    "tiny-bert": {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2},
    "minilm-shaped": {"hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536, "num_hidden_layers": 2},
}
SHAPES = {"tiny-bert": [(3, 11), (2, 24)], "minilm-shaped": [(2, 16), (3, 32)]}


def _graph(name: str, layers: int | None = None) -> ForgeGraph:
    config = dict(MODELS[name], **({} if layers is None else {"num_hidden_layers": layers}))
    model = tiny_bert(num_labels=2, vocab_size=100, max_position_embeddings=64, **config)
    return ForgeGraph(model.eval(), hf_input_names=["input_ids", "attention_mask", "labels"]).train()



@pytest.mark.parametrize("name", sorted(MODELS))
def test_attention_dropout_is_recomputed_and_replayed_bitwise(name: str) -> None:
    """Planned at the smallest reachable peak, every attention (dropout_p 0.1, active in training) is inside a
    checkpointed region; at two shapes the outputs and every gradient equal the unmodified graph's bitwise
    under the same seed, and another seed changes them (the dropout really draws)."""
    mg = _graph(name)
    shapes = [bert_inputs(batch=b, seq=s) for b, s in SHAPES[name]]
    smallest = plan_checkpoints(graph_costs(mg.model, flat_inputs(mg.model, ExampleInputs.coerce(shapes[1]))),
                                None)[1]
    out, info = activation_checkpoint_transform_pass(mg, {"budget_mb": smallest / MB, "data": shapes[1]})
    attention = [m for m in out.model.modules() if isinstance(m, ScaledDotProductAttention)]  # the pass's copy
    recomputed = [m for r in checkpoint_regions(out.model) for m in r.modules()
                  if isinstance(m, ScaledDotProductAttention)]
    assert len(attention) == MODELS[name]["num_hidden_layers"] and all(m.dropout_p > 0 for m in attention)
    assert {id(m) for m in recomputed} == {id(m) for m in attention}, info.segment_nodes
    mg.model.train()
    out.model.train()
    for inputs in shapes:
        ref_out, ref_grad = _step(mg, inputs, seed=5)
        new_out, new_grad = _step(out, inputs, seed=5)
        other_out, _ = _step(out, inputs, seed=6)
        assert all(torch.equal(a, b) for a, b in zip(ref_out, new_out, strict=True)), name
        assert not torch.equal(new_out[-1], other_out[-1])  # the logits: dropout is on
        assert ref_grad.keys() == new_grad.keys()
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in
                   zip(ref_grad.values(), new_grad.values(), strict=True)), name


def test_smallest_reachable_is_at_most_every_layer_checkpointing() -> None:
    """The planner's smallest reachable peak is no higher than its own figure for one segment per encoder layer
    (what torch.utils.checkpoint on every layer keeps). Caps on a segment's inside bytes spread over the sizes
    that occur missed a layer's size by a third on MiniLM 8x128 (82.7 MB reachable, every layer 69.8 MB); here,
    six MiniLM-shaped layers at 4 x 64, they reached 17.4 MB for every layer's 15.1 (refined: 12.1)."""
    mg = _graph("minilm-shaped", layers=6)
    costs = graph_costs(mg.model, flat_inputs(mg.model, ExampleInputs.coerce(bert_inputs(batch=4, seq=64))))
    segments = []
    for k in range(6):
        nodes = [i for i, n in enumerate(costs.nodes) if f"layer.{k}." in str(n.target)]
        first, last = min(nodes), max(nodes)
        segments.append((min(j for j, *_ in costs.spans[last] if j >= first), last))
    every_layer = plan_of(costs, tuple(segments))
    assert every_layer.peak < costs.baseline_peak
    assert plan_checkpoints(costs, None)[1] <= every_layer.peak, (every_layer.peak / MB, segments)


def test_attention_dropout_is_taped_not_redrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's dropout (aten's math kernel draws it on the attention weights) keeps its mask as bits like
    F.dropout: backward of the checkpointed graph draws nothing, where without the attention tape it redraws once
    per recomputed attention; both bitwise equal to the unmodified graph."""
    from fxforge.passes.memory import dropout_tape

    mg = _graph("tiny-bert")
    inputs = bert_inputs(batch=3, seq=24)
    smallest = plan_checkpoints(graph_costs(mg.model, flat_inputs(mg.model, ExampleInputs.coerce(inputs))), None)[1]
    out, _ = activation_checkpoint_transform_pass(mg, {"budget_mb": smallest / MB, "data": inputs})
    attention = sum(isinstance(m, ScaledDotProductAttention) for r in checkpoint_regions(out.model)
                    for m in r.modules())
    assert attention == MODELS["tiny-bert"]["num_hidden_layers"]
    ref_out, ref_grad = _step(mg, inputs, seed=5)
    draws = []
    for taped in (True, False):
        if not taped:
            monkeypatch.setattr(dropout_tape, "attention_dropout", lambda args, kwargs: False)
        out.model.train().zero_grad(set_to_none=True)
        torch.manual_seed(5)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out(**inputs)) if isinstance(t, torch.Tensor)]
        with OpCounts() as backward:  # the step seeded_training_step takes
            torch.stack([t.float().sum() for t in leaves if t.requires_grad]).sum().backward()
        draws.append(backward.of(torch.ops.aten.bernoulli_))
        assert all(torch.equal(a.detach(), b) for a, b in zip(leaves, ref_out, strict=True))
        assert all(torch.equal(p.grad, ref_grad[n]) for n, p in out.model.named_parameters() if p.grad is not None)
    assert draws[0] == 0 and draws[1] >= attention, draws


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script_method.* is deprecated:DeprecationWarning")  # inductor's
def test_regions_compile_without_graph_breaks_and_replay_dropout() -> None:
    """Under torch.compile a region is a plain checkpoint dynamo traces whole (no graph break) and AOTAutograd
    recomputes, replaying its random ops from the state saved in forward: with inductor drawing through aten
    (fallback_random), the compiled checkpointed tiny BERT's outputs and gradients match the eager unmodified
    graph's under the same seed, dropout on, at two shapes (to float rounding: inductor fuses and reorders)."""
    mg = _graph("tiny-bert")
    shapes = [bert_inputs(batch=b, seq=s) for b, s in SHAPES["tiny-bert"]]
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.7, "data": shapes[1]})
    assert info.segments >= 1
    assert_compiled_step_matches(mg, out, shapes)
