"""The bf16 group path of the weight-only lowering: MXINT / block_fp weights of 5-8 bits (and 4-bit ones the int4
pack refuses) run as a bf16 GEMM on their exactly decoded weight, within the stated bound of the simulation on
tiny BERT and the zoo GPT at two shapes, at their packed resident size, through checkpoints and torch.export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.metadata import get_meta
from fxforge.graph.packed import lowered_weight_bits
from fxforge.passes import PASSES
from fxforge.passes.metrics import compare_outputs
from fxforge.passes.quantize import (
    LoweringRecord,
    QuantizedLinear,
    WeightOnlyGroupLinear,
    lower_weight_only_transform_pass,
    quantize_transform_pass,
)
from fxforge.passes.quantize.lower_weight_only import LowerWeightOnlyArgs, lowering_plan
from fxforge.passes.quantize.woq_codes import simulated_bias, simulated_weight
from fxforge.passes.quantize.woq_modules import resident_bytes


def _mx(width: int, block: int, fmt: str = "mxint") -> dict[str, Any]:
    extra = {"weight_exponent_width": 8} if fmt == "block_fp" else {}
    return {"by": "type", "linear": {"config": {"name": fmt, "weight_width": width, "weight_block_size": block,
                                                **extra}}}


def _bert() -> tuple[ForgeGraph, list[dict[str, torch.Tensor]], Any]:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    cases = [bert_inputs(labels=False, batch=b, seq=s) for b, s in ((3, 11), (2, 7))]
    return mg, cases, lambda g, i: g(**i).logits


def _gpt() -> tuple[ForgeGraph, list[torch.Tensor], Any]:
    gen = torch.Generator().manual_seed(3)
    idx = [torch.randint(0, 64, shape, generator=gen) for shape in ((2, 16), (3, 24))]
    return ForgeGraph(make_gpt(n_embd=64), example_inputs=(idx[0],)).eval(), idx, lambda g, i: g(i)


@pytest.mark.parametrize(("width", "block", "fmt"), [(8, 16, "mxint"), (6, 32, "mxint"), (5, 16, "block_fp")])
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_group_path_equals_simulated_within_bound(model: str, width: int, block: int, fmt: str) -> None:
    base, cases, run = _bert() if model == "bert" else _gpt()
    sim, _ = quantize_transform_pass(base.copy(), _mx(width, block, fmt))
    low, info = lower_weight_only_transform_pass(sim)
    linears = {n for n, m in sim.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert info.skipped == {} and set(info.lowered) == linears
    grouped = {p for p, how in info.lowered.items() if how.startswith("group")}
    assert grouped, info.lowered  # (a layer whose one block spans its row takes the int8 per-row kernel)
    for path in grouped:
        layer, ref = low.model.get_submodule(path), sim.model.get_submodule(path)
        assert isinstance(layer, WeightOnlyGroupLinear) and layer.group_size == block and layer.width <= width
        assert info.lowered[path] == f"group g{block}"
        assert torch.equal(layer.dequantized_weight(), simulated_weight(ref)), path  # exact, not within a bound
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    handles = [low.model.get_submodule(p).register_forward_hook(
        lambda m, a, out, p=p: seen.setdefault(p, []).append((a[0].detach(), out.detach()))) for p in grouped]
    contract = PASSES["lower_weight_only_transform_pass"].spec.contract
    assert contract.min_sqnr_db is not None
    for case in cases:  # two input shapes
        with torch.no_grad():
            want, got = run(sim, case), run(low, case)
        assert compare_outputs(want, got).sqnr_db >= contract.min_sqnr_db
    for h in handles:
        h.remove()
    assert set(seen) == grouped
    for path, calls in seen.items():
        layer, ref = low.model.get_submodule(path), sim.model.get_submodule(path)
        assert len(calls) == 2
        for x, y in calls:
            expect = F.linear(x, simulated_weight(ref), simulated_bias(ref))
            excess = (y.double() - expect.double()).abs() - layer.error_bound(x)
            assert excess.max() <= 0, (path, float(excess.max()))
    node = next(n for n in low.model.graph.nodes if n.op == "call_module" and str(n.target) in grouped)
    rec = get_meta(node).software.get(LoweringRecord)
    assert rec is not None and "bf16 GEMM" in rec.kernel and rec.activation.startswith("bf16")


def test_group_layer_is_exact_where_the_arithmetic_is() -> None:
    # inputs in {-1, 0, 1}, codes in [-3, 3], scale 2^-2, K = 32: every sum is a multiple of 2^-2 below 2^5, so
    # the bf16 input, the fp32 sums and the bf16 output are all exact
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-3, 4, (8, 32), generator=gen)
    layer = WeightOnlyGroupLinear.from_codes(codes, torch.full((8, 2), 0.25), 16, 3, None)
    x = torch.randint(-1, 2, (5, 32), generator=gen).float()
    assert torch.equal(layer(x), x @ (codes.float() * 0.25).T)


def test_group_layer_refuses_what_bf16_cannot_hold_exactly() -> None:
    codes = torch.zeros(4, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="signed 6-bit"):
        WeightOnlyGroupLinear.from_codes(codes + 40, torch.ones(4, 2), 16, 6, None)
    with pytest.raises(ValueError, match="powers of two"):
        WeightOnlyGroupLinear.from_codes(codes, torch.full((4, 2), 0.3), 16, 6, None)
    with pytest.raises(ValueError, match="powers of two"):
        WeightOnlyGroupLinear.from_codes(codes, torch.full((4, 2), 2.0**-130), 16, 6, None)
    with pytest.raises(ValueError, match="group_size"):
        WeightOnlyGroupLinear(30, 4, 16)


def test_resident_bytes_checkpoint_and_torch_export(tmp_path: Path) -> None:
    base, cases, run = _gpt()
    sim, _ = quantize_transform_pass(base.copy(), _mx(8, 32))
    low, info = lower_weight_only_transform_pass(sim)
    grouped = [p for p, how in info.lowered.items() if how.startswith("group")]
    expected = 0
    for path in grouped:  # int8 codes, an fp32 scale per group of 32 and row, the fp32 bias; no fp32 weight
        m = low.model.get_submodule(path)
        n, k = m.out_features, m.in_features
        assert m.weight_int8.dtype == torch.int8 and m.weight_scale.shape == (n, k // 32)
        assert resident_bytes(m) == n * k + 4 * n * (k // 32) + (0 if m.bias is None else 4 * n)
        expected += n * k * m.width + 32 * n * (k // 32) + (0 if m.bias is None else 32 * n)
    bits, _ = lowered_weight_bits(nn.ModuleDict({p.replace(".", "_"): low.model.get_submodule(p) for p in grouped}))
    assert bits == expected  # codes counted at their width, not their int8 container's
    loaded = ForgeGraph.from_checkpoint(low.export(tmp_path / "group"))
    assert isinstance(loaded.model.get_submodule(grouped[0]), WeightOnlyGroupLinear)
    for idx in cases:
        with torch.no_grad():
            assert torch.equal(run(loaded, idx), run(low, idx))
    ep = torch.export.export(low.model, (cases[1],))
    with torch.no_grad():
        assert torch.equal(ep.module()(cases[1]), low(cases[1]))


def test_plan_prefers_the_integer_kernels_and_can_leave_the_group_path_off() -> None:
    base, _, _ = _gpt()
    sim, _ = quantize_transform_pass(base.copy(), _mx(4, 32))  # 4-bit: int4 where the pack takes the shape
    plan = lowering_plan(sim)
    assert all(how.startswith(("int4", "group")) for how in plan.values()), plan
    assert any(how.startswith("int4") for how in plan.values())
    wide, _ = quantize_transform_pass(base.copy(), _mx(8, 32))
    assert all(how == "group g32" for how in lowering_plan(wide).values())
    off = lowering_plan(wide, LowerWeightOnlyArgs(group=False))
    assert off and all(how.startswith("skip: ") and "group=False" in how for how in off.values()), off
