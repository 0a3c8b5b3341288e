"""activation_checkpoint_transform_pass: bitwise-equal outputs and gradients (train mode with dropout, eval mode)
on tiny BERT, GPT (attention, AFNO) and A-GRU at two input shapes; checkpoints round-trip; an impossible budget
is refused with the reachable minimum; a budget is met on the allocator's measured peak."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import OpCounts, assert_steps_bitwise_equal, bert_inputs, make_agru, make_gpt, make_tiny_bert
from conftest import seeded_training_step as _step

from fxforge import ForgeGraph, passes
from fxforge.graph.inputs import ExampleInputs
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.analysis.step_memory import measured_step_bytes
from fxforge.passes.memory import activation_checkpoint_transform_pass
from fxforge.passes.memory.activation_checkpoint import MB, checkpoint_regions
from fxforge.passes.memory.checkpoint_plan import graph_costs, plan_checkpoints, plan_of
from fxforge.passes.propagate import flat_inputs

BERT_SHAPES = [bert_inputs(batch=3, seq=11), bert_inputs(batch=2, seq=7)]


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    """Tiny BERT with metadata, captured once for the module (tests transform copies)."""
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


@pytest.fixture(scope="module")
def bert_checkpointed(bert: ForgeGraph) -> tuple[ForgeGraph, Any]:
    return activation_checkpoint_transform_pass(bert, {"fraction": 0.75})


def _gpt(mixer: str) -> Callable[[], tuple[ForgeGraph, list[dict[str, torch.Tensor]]]]:
    def build() -> tuple[ForgeGraph, list[dict[str, torch.Tensor]]]:
        gen = torch.Generator().manual_seed(4)
        shapes = [torch.randint(0, 64, s, generator=gen) for s in ((2, 16), (3, 24))]
        return ForgeGraph(make_gpt(mixer), example_inputs=(shapes[0],)), [{"idx": x} for x in shapes]
    return build


def _agru() -> tuple[ForgeGraph, list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, 5, 8, generator=gen), torch.randn(48, 5, 8, generator=gen)]  # a region's ~5 KB RNG state
    # must be worth less than what it drops
    return ForgeGraph(make_agru(), example_inputs=(xs[0],)), [{"x": x} for x in xs]


MODELS = {"gpt-attn": _gpt("attn"), "gpt-afno": _gpt("afno"), "agru": _agru}



@pytest.mark.parametrize("model", ["bert", *sorted(MODELS)])
def test_outputs_and_gradients_are_bitwise_equal(model: str, request: pytest.FixtureRequest) -> None:
    if model == "bert":
        mg, shapes = request.getfixturevalue("bert"), BERT_SHAPES
        out, info = request.getfixturevalue("bert_checkpointed")
    else:
        mg, shapes = MODELS[model]()
        out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.8})
    assert info.segments == len(checkpoint_regions(out.model)) >= 1, info
    assert info.planned_peak_bytes <= info.budget_bytes < info.baseline_peak_bytes
    assert 0 < info.recompute_fraction <= 1.0 + 1e-9
    assert [n for n, _ in out.model.named_parameters()] == [n for n, _ in mg.model.named_parameters()]
    assert_steps_bitwise_equal(mg, out, shapes)


def test_dropout_is_replayed_not_disabled(bert_checkpointed: tuple[ForgeGraph, Any]) -> None:
    out, inputs = bert_checkpointed[0].copy(), BERT_SHAPES[0]
    out.model.train()
    first, _ = _step(out, inputs, seed=1)
    other, _ = _step(out, inputs, seed=2)
    again, _ = _step(out, inputs, seed=1)
    assert not torch.equal(first[0], other[0])  # dropout is active in the checkpointed graph
    assert torch.equal(first[0], again[0])


def test_impossible_budget_is_refused_with_the_reachable_minimum(bert: ForgeGraph) -> None:
    mg = bert
    with pytest.raises(PassError, match="smallest peak any plan reaches") as err:
        activation_checkpoint_transform_pass(mg, {"budget_mb": 0.01})
    smallest = float(re.search(r"reaches, ([0-9.]+) MB", str(err.value)).group(1))  # type: ignore[union-attr]
    out, info = activation_checkpoint_transform_pass(mg, {"budget_mb": smallest + 1e-4})  # just reachable
    assert info.planned_peak_bytes <= (smallest + 1e-4) * MB and info.segments >= 1
    for bad in ({}, {"budget_mb": 1.0, "fraction": 0.5}, {"fraction": 1.5}):
        with pytest.raises(PassArgsError):
            activation_checkpoint_transform_pass(mg, bad)
    frozen = mg.copy()
    for p in frozen.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(PassError, match="nothing in the graph requires grad"):
        activation_checkpoint_transform_pass(frozen, {"fraction": 0.75})


def test_a_budget_above_the_baseline_changes_nothing(bert: ForgeGraph) -> None:
    mg = bert
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 1.0})
    assert info.segments == 0 and info.recompute_fraction == 0.0 and not info.changed
    assert out.model.code == mg.model.code


def test_checkpoint_round_trip(bert: ForgeGraph, bert_checkpointed: tuple[ForgeGraph, Any], tmp_path: Path) -> None:
    mg, shapes = bert, BERT_SHAPES
    out, info = bert_checkpointed[0].copy(), bert_checkpointed[1]
    back = ForgeGraph.from_checkpoint(out.export(tmp_path / "ckpt"))
    assert len(checkpoint_regions(back.model)) == info.segments
    assert dict(back.model.named_parameters()).keys() == dict(mg.model.named_parameters()).keys()
    out.model.train()
    back.model.train()
    for inputs in shapes:  # train mode: the checkpointed path, dropout on
        ref_out, ref_grad = _step(out, inputs, seed=3)
        new_out, new_grad = _step(back, inputs, seed=3)
        assert all(torch.equal(a, b) for a, b in zip(ref_out, new_out, strict=True))
        assert all(torch.equal(ref_grad[k], new_grad[k]) for k in ref_grad)


def test_metadata_after_the_pass_equals_a_fresh_run(bert_checkpointed: tuple[ForgeGraph, Any]) -> None:
    out = bert_checkpointed[0]
    fresh, _ = passes.add_common_metadata_analysis_pass(passes.init_metadata_analysis_pass(out.copy())[0])
    assert [out.meta(n).common.to_json() for n in out.model.graph.nodes] == \
        [fresh.meta(n).common.to_json() for n in fresh.model.graph.nodes]


def test_budget_is_met_on_the_measured_peak(bert: ForgeGraph) -> None:
    """Tiny BERT at 8 x 64: the allocator's peak over forward + backward, with 10% + 64 KiB slack for allocator
    noise (alignment, autograd's small bookkeeping tensors), is within the budget; the unmodified graph is not."""
    inputs = bert_inputs(batch=8, seq=64)
    mg = bert.copy().train()
    flat = flat_inputs(mg.model, ExampleInputs.coerce(inputs))
    before = measured_step_bytes(mg.model, flat)
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.6, "data": inputs})
    after = measured_step_bytes(out.model, flat)
    slack = 0.10 * info.budget_bytes + 64 * 1024
    assert after <= info.budget_bytes + slack, (after, info)
    assert before > info.budget_bytes + slack, (before, info)
    # the plan's estimate follows the measured peak, not a loose bound (backward frees what it passed: a segment
    # early in the graph is recomputed beside what is kept before it only; kept + the largest inside estimated
    # 3.70 MB here for 3.40 measured, and ~20 % high on MiniLM 8x128, so plans over-saved). Here 13 % low.
    assert abs(info.planned_peak_bytes - after) <= 0.15 * after, (after, info)
    print(f"measured peak {before / MB:.2f} MB -> {after / MB:.2f} MB; estimated {info.baseline_peak_bytes / MB:.2f}"
          f" -> {info.planned_peak_bytes / MB:.2f} MB; budget {info.budget_bytes / MB:.2f} MB")


def test_batch_norm_stays_out_of_segments() -> None:
    """Recomputing a BatchNorm in training mode would update its running statistics twice: it is never put in a
    segment, and planning (a training-mode run) leaves the statistics as they were."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.BatchNorm1d(64), *layers, torch.nn.Linear(64, 4))
    x = torch.randn(128, 8)
    mg = ForgeGraph(net, (x,), frontend="fx").train()
    stats = mg.model.get_submodule("1").running_mean.clone()
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.8})
    assert torch.equal(out.model.get_submodule("1").running_mean, stats)
    assert info.segments >= 1
    assert not any(isinstance(m, torch.nn.BatchNorm1d) for r in checkpoint_regions(out.model) for m in r.modules())
    _step(mg, {"input": x}, seed=0)
    _step(out, {"input": x}, seed=0)
    assert torch.equal(out.model.get_submodule("1").running_mean, mg.model.get_submodule("1").running_mean)


def test_no_segment_of_the_plan_could_be_dropped() -> None:
    """Least recomputation: at budgets between the smallest reachable peak and the baseline, the chosen plan keeps
    no segment it could do without (dropping any one would exceed the budget). A GPT's identical blocks cost the
    same, so a price on recomputation alone takes all of them or none; the budget may need only some."""
    mg, shapes = _gpt("attn")()
    costs = graph_costs(mg.model, flat_inputs(mg.model, ExampleInputs.coerce(shapes[1])))
    smallest = plan_checkpoints(costs, None)[1]
    for k in range(1, 10):
        budget = smallest + (costs.baseline_peak - smallest) * k // 10
        plan, _ = plan_checkpoints(costs, budget)
        assert plan is not None and plan.peak <= budget and plan_of(costs, plan.segments) == plan
        for s in range(len(plan.segments)):
            fewer = plan_of(costs, plan.segments[:s] + plan.segments[s + 1:])
            assert fewer.peak > budget, (k, plan, fewer)


def test_dropout_in_a_region_keeps_its_mask_as_bits() -> None:
    """A checkpointed region's dropout is not redrawn in recomputation (the CPU draw dominated its cost): backward
    draws only for the random ops that are not F.dropout (here an AlphaDropout between two Dropouts, in the same
    region: the RNG state after each kept mask is replayed, so its draw is the forward's). Outputs and gradients
    stay bitwise those of the original graph."""
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(16, 256), nn.Dropout(0.3), nn.AlphaDropout(0.2), nn.Linear(256, 256), nn.Tanh(),
                        nn.Dropout(0.3), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    x = torch.randn(64, 16)
    mg = ForgeGraph(net, (x,), frontend="fx").train()
    smallest = plan_checkpoints(graph_costs(mg.model, [x]), None)[1]
    out, info = activation_checkpoint_transform_pass(mg, {"budget_mb": smallest / MB})
    kinds = [type(m) for r in checkpoint_regions(out.model) for m in r.children()]
    taped, alpha = kinds.count(nn.Dropout), kinds.count(nn.AlphaDropout)
    assert taped >= 1 and alpha == 1, kinds  # the case this test is about: both kinds recomputed
    ref_out, ref_grad = _step(mg, {"input": x}, seed=11)
    out.model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    with OpCounts() as forward:
        y = out(x)
    with OpCounts() as backward:
        y.float().sum().backward()
    assert forward.of(torch.ops.aten.bernoulli_) == 3 and backward.of(torch.ops.aten.bernoulli_) == alpha
    assert torch.equal(y.detach(), ref_out[0])
    assert all(torch.equal(p.grad, ref_grad[n]) for n, p in out.model.named_parameters())


def test_attention_is_priced_by_its_matmuls() -> None:
    """The FLOP counter has no formula for CPU flash attention (it counts 0), so the planner took a long sequence's
    costliest op for free and recomputed it: a causal attention costs 2 x B x H x L x S x E (half of Q K^T + P V)
    beyond its result bytes, and at T = 128 more than the linear that makes q, k and v."""
    mg = ForgeGraph(make_gpt("attn", sequence_length=128), example_inputs=(torch.zeros(2, 128, dtype=torch.long),))
    costs = graph_costs(mg.model, [torch.randint(0, 64, (2, 128))])
    index = {n.name: i for i, n in enumerate(costs.nodes)}
    attn = costs.nodes[index["scaled_dot_product_attention"]]
    q = attn.args[0].meta.get("tensor_meta") if isinstance(attn.args[0], torch.fx.Node) else None
    batch, heads, length, width = (2, 2, 128, 16) if q is None else tuple(q.shape)
    result = 4 * batch * heads * length * width * 4  # the output's bytes x 4
    assert costs.cost[index["scaled_dot_product_attention"]] == 2 * batch * heads * length * length * width + result
    qkv = next(i for n, i in index.items() if n.endswith("c_attn"))
    assert costs.cost[index["scaled_dot_product_attention"]] > costs.cost[qkv]
