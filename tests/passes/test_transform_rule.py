"""The one rule of transforms: a transform never changes its input graph; it returns a new one.

MASE's tutorial 6 calls ``quantize_transform_pass(mg, cfg)`` once per trial on one base graph; internal
callers that own their graph use ``pass.apply_inplace`` and pay no copy.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, bert_metadata_graph
from pass_cases import FIXED_LINEAR, case, registered

from fxforge import ForgeGraph, passes
from fxforge.passes import PASSES, PassError
from fxforge.passes.quantize import quantize_transform_pass

DATA = [bert_inputs(labels=False, batch=2, seq=9)]
INT8_STATIC = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "weight_width": 8}}}


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    return bert_metadata_graph()


def logits(mg: ForgeGraph) -> torch.Tensor:
    with torch.no_grad():
        return mg(**DATA[0]).logits


def outputs(mg: ForgeGraph) -> torch.Tensor | str:
    """The logits, or why the graph refuses to run (an uncalibrated static quantizer must stay so)."""
    try:
        return logits(mg).clone()
    except RuntimeError as exc:
        return str(exc)


def state(mg: ForgeGraph) -> dict[str, Any]:
    """What a transform could change on its input: outputs, tensors, flags, modules, code, history."""
    return {
        "out": outputs(mg),
        "state": {k: v.detach().clone() for k, v in mg.model.state_dict(keep_vars=True).items()},
        "grad": {k: p.requires_grad for k, p in mg.model.named_parameters()},
        "types": {k: type(m) for k, m in mg.model.named_modules()},
        "code": mg.model.code,
        "history": [r.to_json() for r in mg.history],
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    if isinstance(before["out"], str):
        assert before["out"] == after["out"]
    else:
        assert isinstance(after["out"], torch.Tensor) and torch.equal(before["out"], after["out"])
    for key in ("grad", "types", "code", "history"):
        assert before[key] == after[key], key
    assert before["state"].keys() == after["state"].keys()
    assert all(torch.equal(v, after["state"][k]) for k, v in before["state"].items())


def test_tutorial6_loop_quantizes_one_base_graph_per_trial(base: ForgeGraph) -> None:
    before = state(base)
    outs = []
    for width in (8, 6):
        cfg = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": width,
                                                   "data_in_frac_width": width - 3, "weight_width": width,
                                                   "weight_frac_width": width - 2}}}
        mg, info = quantize_transform_pass(base, cfg)  # MASE's loop: no copy by the user
        assert mg is not base and info.quantized_nodes == 14
        assert mg.history[-1].name == "quantize_transform_pass"
        outs.append(logits(mg))
        assert_unchanged(before, state(base))
    assert not torch.equal(outs[0], before["out"]) and not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", registered("transform"))
def test_every_transform_leaves_its_input_unchanged(base: ForgeGraph, name: str) -> None:
    mg = base.copy()
    for pre, args in case(name).setup:
        mg, _ = PASSES[pre].apply_inplace(mg, args(DATA))
    before = state(mg)
    out, _ = PASSES[name](mg, case(name).args(DATA))
    assert out is not mg and out.history[-1].name == name
    assert_unchanged(before, state(mg))


def test_apply_inplace_changes_and_returns_the_graph_given(base: ForgeGraph) -> None:
    mg = base.copy()
    out, info = quantize_transform_pass.apply_inplace(mg, FIXED_LINEAR)
    assert out is mg and info.quantized_nodes == 14 and mg.history[-1].name == "quantize_transform_pass"
    assert not torch.equal(logits(mg), logits(base))
    assert quantize_transform_pass.apply_inplace.__doc__  # documented entry, not a bare lambda
    # analysis passes write metadata on the graph given, with or without the in-place entry
    cp = base.copy()
    out, _ = passes.count_op_analysis_pass(cp)
    assert out is cp


def test_refusal_on_a_transformed_graph_says_what_to_do(base: ForgeGraph) -> None:
    quantized, _ = quantize_transform_pass(base, FIXED_LINEAR)
    with pytest.raises(PassError) as err:
        quantize_transform_pass(quantized, copy.deepcopy(FIXED_LINEAR))
    message = str(err.value)
    assert "cannot run on a graph where 'quantized' holds" in message
    assert "leaves its input unchanged" in message and "base graph" in message, message
    quantize_transform_pass(base, FIXED_LINEAR)  # the base graph still takes it


class TwiceSin(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + torch.sin(x) * 2


def test_transforms_report_whether_they_changed_the_graph(base: ForgeGraph) -> None:
    mg = ForgeGraph(TwiceSin(), torch.randn(3, 4), frontend="fx")
    once, info = passes.cse_transform_pass(mg)
    assert info.changed is True and info.to_json()["changed"] is True
    _, again = passes.cse_transform_pass(once)
    assert again.changed is False
    _, counted = passes.count_op_analysis_pass(mg)  # analysis passes change no graph and say nothing
    assert counted.changed is None and "changed" not in counted.to_json()
    # weights changed in place (no new node or module) count too
    quantized, _ = quantize_transform_pass(base, copy.deepcopy(INT8_STATIC))
    _, calibrated = passes.calibrate_transform_pass(quantized, {"data": DATA})
    assert calibrated.changed is True
    _, pruned = passes.prune_transform_pass(base, {"weight": {"sparsity": 0.2}})
    assert pruned.changed is True


def test_optimize_pipeline_stops_when_no_step_changed_the_graph() -> None:
    mg = ForgeGraph(TwiceSin(), torch.randn(3, 4), frontend="fx")
    code = mg.model.code
    out, info = passes.optimize_graph_pipeline(mg)
    assert mg.model.code == code and out is not mg  # a pipeline of transforms follows the rule too
    per_round = len(info.steps) // info.rounds
    assert info.rounds == 2 and len(info.steps) == 2 * per_round
    assert any(s["changed"] for _, s in info.steps[:per_round])
    assert not any(s["changed"] for _, s in info.steps[per_round:])
