"""activation_checkpoint_transform_pass with ``selective``: regions keep their matrix multiplies' and attentions'
results (True) or their attentions' only ("attention") and recompute the rest. Outputs and gradients bitwise
equal (dropout replayed) on tiny BERT and the zoo GPT at two shapes, eager; what backward replays; the planner's
memory model for such regions; the budget met on the measured peak; a checkpoint keeps the mode; a
full-recompute checkpoint written before the mode existed still loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    OpCounts,
    assert_compiled_step_matches,
    assert_steps_bitwise_equal,
    bert_inputs,
    make_gpt,
    make_tiny_bert,
)
from conftest import seeded_training_step as _step

from fxforge import ForgeGraph
from fxforge.graph.inputs import ExampleInputs
from fxforge.passes import PassArgsError
from fxforge.passes.analysis.step_memory import measured_step_bytes
from fxforge.passes.memory import activation_checkpoint_transform_pass
from fxforge.passes.memory.activation_checkpoint import checkpoint_regions
from fxforge.passes.memory.checkpoint_plan import graph_costs, plan_checkpoints, plan_of
from fxforge.passes.memory.checkpoint_region import ATTENTION_OPS, _from_config, _to_config
from fxforge.passes.propagate import flat_inputs

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def _bert() -> tuple[ForgeGraph, list[dict[str, torch.Tensor]]]:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    return mg, [bert_inputs(batch=3, seq=11), bert_inputs(batch=2, seq=7)]


def _gpt() -> tuple[ForgeGraph, list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(4)
    shapes = [torch.randint(0, 64, s, generator=gen) for s in ((2, 16), (3, 24))]
    return ForgeGraph(make_gpt("attn"), example_inputs=(shapes[0],)), [{"idx": x} for x in shapes]


@pytest.mark.parametrize("mode", [True, "attention"], ids=["matmuls", "attention"])
@pytest.mark.parametrize("build", [_bert, _gpt], ids=["bert", "gpt"])
def test_selective_regions_are_bitwise_equal(build: Any, mode: bool | str) -> None:
    mg, shapes = build()
    # the GPT's attention is a fused kernel whose result a selective region keeps, like its linears', so regions
    # save little there (what they drop: LayerNorm and GELU outputs); planned on a larger input than its example
    plan_on = {"idx": torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))} \
        if build is _gpt else None
    fraction = 0.99 if build is _gpt else 0.9
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": fraction, "selective": mode, "data": plan_on})
    regions = checkpoint_regions(out.model)
    assert info.segments == len(regions) >= 1 and all(r.selective is mode for r in regions)
    assert info.planned_peak_bytes <= info.budget_bytes
    assert_steps_bitwise_equal(mg, out, shapes)


def _backward_counts(graph: ForgeGraph, inputs: dict[str, torch.Tensor]) -> OpCounts:
    graph.model.train().zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = graph(**inputs)
    loss = out["loss"] if isinstance(out, dict) else out.float().sum()
    with OpCounts() as backward:
        loss.backward()
    return backward


def test_selective_regions_do_not_recompute_their_linears() -> None:
    """The same regions, full then selective: backward of a full region replays every linear's multiply, a
    selective one none (its kept results are reused), so the multiplies counted in backward differ by exactly
    the number of linears inside the regions."""
    mg, shapes = _bert()
    full, info = activation_checkpoint_transform_pass(mg.train(), {"fraction": 0.7})
    sel = full.copy()
    for region in checkpoint_regions(sel.model):
        region.selective = True
    linears = sum(isinstance(m, torch.nn.Linear) for r in checkpoint_regions(full.model) for m in r.children())
    assert info.segments >= 1 and linears >= 1
    counts = [_backward_counts(graph, shapes[0]).of(*MATMULS) for graph in (full, sel)]
    assert counts[0] - counts[1] == linears, counts


def test_attention_regions_replay_their_linears_not_their_attention() -> None:
    """On the zoo GPT (fused attention): backward of full regions runs each attention kernel inside them again;
    regions keeping only their attentions' results run none of them again but every linear, as full ones do."""
    mg, shapes = _gpt()
    data = {"idx": torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))}
    full, info = activation_checkpoint_transform_pass(mg.train(), {"fraction": 0.6, "data": data})
    kept = full.copy()
    for region in checkpoint_regions(kept.model):
        region.selective = "attention"
    inside = sum(n.target is torch.nn.functional.scaled_dot_product_attention
                 for r in checkpoint_regions(full.model) for n in r.body().graph.nodes)
    assert info.segments >= 1 and inside >= 1
    a, b = (_backward_counts(graph, shapes[1]) for graph in (full, kept))
    assert a.of(*ATTENTION_OPS) == inside and b.of(*ATTENTION_OPS) == 0, (a.calls, b.calls, inside)
    assert a.of(*MATMULS) == b.of(*MATMULS) > 0
    assert_steps_bitwise_equal(full, kept, shapes)


def test_the_planner_prices_selective_segments() -> None:
    """Against full recomputation: a selective segment keeps more bytes (the kept results) and recomputes less
    (not its matrix multiplies), for the same nodes; so the smallest reachable peak is higher."""
    mg, shapes = _gpt()
    flat = flat_inputs(mg.model, ExampleInputs.coerce(shapes[1]))
    full, attn, sel = (graph_costs(mg.model, flat, selective=m) for m in (False, "attention", True))
    assert full.saved == attn.saved == sel.saved and full.cost == attn.cost == sel.cost
    pairs = [0, 0]
    for a, b, c in zip(full.spans, attn.spans, sel.spans, strict=True):  # attention keeps a subset of True's
        for (j, inside, kept, work), (j2, inside2, kept2, work2), (j3, inside3, kept3, work3) in zip(a, b, c,
                                                                                                     strict=True):
            assert j == j2 == j3 and inside3 <= inside2 <= inside and kept <= kept2 <= kept3 and work3 <= work2 <= work
            pairs[0] += kept2 > kept and work2 < work
            pairs[1] += kept3 > kept2 and work3 < work2
    assert min(pairs) > 0  # segments holding an attention, or a linear: some results kept, not recomputed


@pytest.mark.parametrize("mode", [True, "attention"], ids=["matmuls", "attention"])
def test_kept_results_count_once_in_a_plan(mode: bool | str) -> None:
    """A selective plan's estimated peak exceeds the full plan's over the same segments by at most the bytes the
    regions keep (their kept results are those bytes, not also their nodes' saved bytes)."""
    mg, shapes = _gpt()
    flat = flat_inputs(mg.model, ExampleInputs.coerce(shapes[1]))
    full, sel = graph_costs(mg.model, flat), graph_costs(mg.model, flat, selective=mode)
    plan, _ = plan_checkpoints(full, int(0.6 * full.baseline_peak))
    assert plan is not None and plan.segments
    extra = 0
    for a, b in plan.segments:
        (kept_full,), (kept_sel,) = ([k for j, _, k, _ in c.spans[b] if j == a] for c in (full, sel))
        extra += kept_sel - kept_full
    assert extra > 0
    assert plan_of(sel, plan.segments).peak - plan_of(full, plan.segments).peak <= extra


def test_selective_budget_is_met_on_the_measured_peak() -> None:
    """Tiny BERT at 8 x 64, as the full-recompute test: the allocator's peak within the budget (10% + 64 KiB
    slack), the unmodified graph's above it."""
    mg, _ = _bert()
    inputs = bert_inputs(batch=8, seq=64)
    mg = mg.train()
    flat = flat_inputs(mg.model, ExampleInputs.coerce(inputs))
    before = measured_step_bytes(mg.model, flat)
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.7, "data": inputs, "selective": True})
    after = measured_step_bytes(out.model, flat)
    slack = 0.10 * info.budget_bytes + 64 * 1024
    assert info.segments >= 1 and after <= info.budget_bytes + slack, (after, info)
    assert before > info.budget_bytes + slack, (before, info)


@pytest.mark.parametrize("mode", [True, "attention"], ids=["matmuls", "attention"])
def test_selective_mode_round_trips_and_old_configs_load(tmp_path: Path, mode: bool | str) -> None:
    mg, shapes = _bert()
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.9, "selective": mode})
    back = ForgeGraph.from_checkpoint(out.export(tmp_path / "ckpt"))
    assert [r.selective for r in checkpoint_regions(back.model)] == [mode] * info.segments
    out.model.train()
    back.model.train()
    ref_out, ref_grad = _step(out, shapes[0], seed=3)
    new_out, new_grad = _step(back, shapes[0], seed=3)
    assert all(torch.equal(a, b) for a, b in zip(ref_out, new_out, strict=True))
    assert all(torch.equal(ref_grad[k], new_grad[k]) for k in ref_grad)
    region = checkpoint_regions(out.model)[0]
    config = _to_config(region)
    assert config["selective"] == mode
    old = {k: v for k, v in config.items() if k != "selective"}  # a full region's config, as written before
    assert _from_config(old).selective is False
    from fxforge.graph.targets import CheckpointError
    for bad in ("yes", 1, "Attention", ["attention"]):
        with pytest.raises(CheckpointError, match="selective must be true, false or 'attention'"):
            _from_config({**config, "selective": bad})
        with pytest.raises(PassArgsError):
            activation_checkpoint_transform_pass(mg, {"fraction": 0.8, "selective": bad})


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:.*torch\.jit\.script_method.* is deprecated:DeprecationWarning")  # inductor's
def test_selective_regions_compile_without_graph_breaks() -> None:
    """Under torch.compile a selective region is traced whole with its policy (AOTAutograd keeps the policy's
    results, recomputes the rest and replays dropout): the compiled graph's outputs and gradients match the eager
    unmodified graph's under the same seed, dropout on, at two shapes (to float rounding)."""
    mg, shapes = _bert()
    out, info = activation_checkpoint_transform_pass(mg, {"fraction": 0.9, "selective": True})
    assert info.segments >= 1
    assert_compiled_step_matches(mg, out, shapes)


def test_liveness_counts_what_selective_regions_keep() -> None:
    """The liveness analysis after a selective plan: its step estimate within 10% of the peak it measures (the
    regions' kept results counted), and above what the same regions would keep if they recomputed everything."""
    from fxforge import passes

    mg, _ = _bert()
    inputs = bert_inputs(batch=8, seq=64)
    out, info = activation_checkpoint_transform_pass(mg.train(), {"fraction": 0.7, "data": inputs,
                                                                  "selective": True})
    g = out.copy()
    passes.init_metadata_analysis_pass(g)
    _, sel = passes.liveness_analysis_pass(g, {"measure": True, "data": inputs})
    assert sel.measured_step_bytes and abs(sel.peak_step_bytes - sel.measured_step_bytes) <= \
        0.10 * sel.measured_step_bytes, (sel.peak_step_bytes, sel.measured_step_bytes)
    regions = checkpoint_regions(g.model)
    for region in regions:
        region.selective = False
    _, full = passes.liveness_analysis_pass(g, {"data": inputs})
    assert full.peak_step_bytes < sel.peak_step_bytes
