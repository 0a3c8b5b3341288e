"""activation_checkpoint_transform_pass with ``measure``: the budget fitted on the allocator's measured peak of
candidate plans, not the planner's estimate. The search itself (fit_measured) against measurements that run
above and below the estimate; the pass on tiny BERT: the budget met on the allocator, outputs and gradients
bitwise equal at two shapes, the caller's RNG untouched, an unreachable budget refused with the measured figure."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_steps_bitwise_equal, bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.inputs import ExampleInputs
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.analysis.step_memory import measured_step_bytes
from fxforge.passes.memory import activation_checkpoint_transform_pass
from fxforge.passes.memory.checkpoint_plan import GraphCosts, Plan, graph_costs, plan_checkpoints
from fxforge.passes.memory.measured_fit import fit_measured
from fxforge.passes.propagate import flat_inputs


def _gpt_costs() -> GraphCosts:
    mg = ForgeGraph(make_gpt("attn"), example_inputs=(torch.randint(0, 64, (2, 16)),))
    data = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    return graph_costs(mg.model, flat_inputs(mg.model, ExampleInputs.coerce({"idx": data})))


@pytest.mark.parametrize("ratio", [0.85, 1.10], ids=["estimate-high", "estimate-low"])
def test_fit_measured_follows_the_measurement(ratio: float) -> None:
    """A 'measurement' ``ratio`` x each plan's estimate: the plan chosen measures within the budget, is the
    cheapest of those measured within it, and each distinct plan is measured once. Where the estimate runs high
    the fit recomputes no more than the estimate's own plan; where it runs low, it refuses that plan."""
    costs = _gpt_costs()
    budget = int(0.6 * costs.baseline_peak)
    calls: list[Plan] = []

    def measure(plan: Plan) -> int:
        calls.append(plan)
        return int(plan.peak * ratio)

    fit = fit_measured(costs, budget, measure)
    own, _ = plan_checkpoints(costs, budget)
    assert fit.plan is not None and own is not None and fit.measured is not None
    assert fit.measured == int(fit.plan.peak * ratio) <= budget
    assert len(calls) == len({p.segments for p in calls}) == fit.measured_plans >= 2
    assert fit.plan.cost == min(p.cost for p in calls if int(p.peak * ratio) <= budget)
    if ratio < 1:
        assert fit.plan.cost <= own.cost
    else:
        assert int(own.peak * ratio) > budget and fit.plan.peak < own.peak


def test_fit_measured_refuses_when_nothing_measures_within() -> None:
    costs = _gpt_costs()
    budget = int(0.6 * costs.baseline_peak)
    fit = fit_measured(costs, budget, lambda plan: budget + 1)
    assert fit.plan is None and fit.measured is None and fit.least_measured == budget + 1
    assert fit.measured_plans >= 1


def test_measured_mode_meets_the_budget_on_the_allocator() -> None:
    """Tiny BERT planned at 8 x 64 for 0.6 x its measured unmodified peak: the chosen plan's measured peak is
    within the budget and is what the allocator measures on the pass's output; the caller's RNG state is not
    consumed; outputs and gradients bitwise equal to the unmodified graph at two other shapes."""
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).train()
    inputs = bert_inputs(batch=8, seq=64)
    flat = flat_inputs(mg.model, ExampleInputs.coerce(inputs))
    before = measured_step_bytes(mg.model, flat)
    budget_mb = 0.6 * before / 2**20
    rng = torch.get_rng_state()
    out, info = activation_checkpoint_transform_pass(mg, {"budget_mb": budget_mb, "data": inputs, "measure": True})
    assert torch.equal(rng, torch.get_rng_state())
    assert info.segments >= 1 and info.measured_plans >= 1
    assert info.measured_peak_bytes is not None and info.measured_peak_bytes <= info.budget_bytes
    out.model.train()
    assert abs(measured_step_bytes(out.model, flat) - info.measured_peak_bytes) <= 64 * 1024
    assert_steps_bitwise_equal(mg, out, [bert_inputs(batch=3, seq=11), bert_inputs(batch=2, seq=7)])


def test_measured_mode_refuses_an_unreachable_budget() -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).train()
    with pytest.raises(PassError, match=r"below the smallest peak measured, [0-9.]+ MB over [0-9]+ plans"):
        activation_checkpoint_transform_pass(mg, {"budget_mb": 1e-3, "data": bert_inputs(batch=8, seq=64),
                                                  "measure": True})
    with pytest.raises(PassArgsError, match="measure"):
        activation_checkpoint_transform_pass(mg, {"fraction": 0.5, "measure": "yes"})
