"""Every transform, on a real model: its declared numerical contract holds at two input shapes, and the
metadata it leaves equals what the metadata passes compute afresh (the rewrite engine's promise)."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, bert_metadata_graph, make_gpt
from pass_cases import FIXED_CLASSIFIER

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes.base import PASSES
from fxforge.passes.metrics import compare_outputs

INT8 = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_dynamic": True,
                                            "data_in_symmetric": False, "weight_width": 8,
                                            "weight_granularity": "per_channel"}}}
STATIC = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "weight_width": 8}}}
MIXED = {**INT8, "matmul": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 5,
                                       "weight_width": 8, "weight_frac_width": 5}}}
MXINT4 = {"by": "type", "linear": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}}
SHAPES = [(3, 11), (2, 7)]


def _perturb_lora(mg: ForgeGraph) -> None:
    with torch.no_grad():
        for m in mg.model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(std=0.05)


# (transform, args, set-up: passes run before it, extra set-up)
CASES: dict[str, tuple[str, dict[str, Any], list[tuple[str, dict[str, Any]]], Callable[[ForgeGraph], None] | None]] = {
    "remove_dropout": ("remove_dropout_transform_pass", {}, [], None),
    "freeze": ("freeze_transform_pass", {"targets": {"name": "embeddings"}}, [], None),
    "unfreeze": ("unfreeze_transform_pass", {"targets": {"name": "embeddings"}},
                 [("freeze_transform_pass", {"targets": {"type": "linear"}})], None),
    "lora_insert": ("insert_lora_adapter_transform_pass", {"rank": 4, "trainable": {"name": "classifier"}}, [], None),
    "lora_fuse": ("fuse_lora_weights_transform_pass", {},
                  [("insert_lora_adapter_transform_pass", {"rank": 4, "exclude": {"name": "classifier"}})],
                  _perturb_lora),
    "quantize": ("quantize_transform_pass", MIXED, [], None),
    "calibrate": ("calibrate_transform_pass", {"data": [bert_inputs(labels=False)]},
                  [("quantize_transform_pass", STATIC)], None),
    "gptq": ("gptq_transform_pass", {"config": INT8, "data": [bert_inputs(labels=False)]}, [], None),
    "awq": ("awq_transform_pass", {"config": INT8, "data": [bert_inputs(labels=False)]}, [], None),
    "rotate": ("rotate_hadamard_transform_pass", {"mode": "online"}, [], None),  # post-LN: linear inputs rotated
    "lower_int8": ("lower_int8_transform_pass", {"backend": "fbgemm"}, [("quantize_transform_pass", INT8)], None),
    "lower_weight_only": ("lower_weight_only_transform_pass", {}, [("quantize_transform_pass", MXINT4)], None),
    "prune": ("prune_transform_pass", {"weight": {"sparsity": 0.2, "scope": "global"}}, [], None),
    "shrink": ("shrink_transform_pass", {}, [("prune_transform_pass", {"weight": {"sparsity": s, "granularity": g}})
                                            for s, g in ((0.5, "head"), (0.5, "ffn"))], None),
    "conv_bn_fusion": ("conv_bn_fusion_transform_pass", {}, [], None),  # no BatchNorm: tests/passes/test_conv_bn_fusion
    "attention_swap": ("attention_swap_transform_pass", {"kv_heads": 2}, [], None),
    "cse": ("cse_transform_pass", {}, [], None),
    "dce": ("dce_transform_pass", {}, [], None),
    "hoist": ("hoist_parameter_subgraphs_transform_pass", {}, [], None),
    "batch_matmuls": ("batch_matmuls_transform_pass", {}, [], None),
    "fuse_elementwise": ("fuse_elementwise_transform_pass", {}, [], None),
    "fold_constants": ("fold_constants_transform_pass", {}, [], None),
    "fuse_kernels": ("fuse_kernels_transform_pass", {}, [], None),
    "activation_checkpoint": ("activation_checkpoint_transform_pass", {"fraction": 0.9}, [], None),
    "activation_checkpoint_selective": ("activation_checkpoint_transform_pass", {"fraction": 0.95, "selective": True},
                                        [], None),
    "activation_checkpoint_attention_measured": ("activation_checkpoint_transform_pass",
                                                 {"fraction": 0.95, "selective": "attention", "measure": True},
                                                 [], None),
    "buffer_reuse": ("buffer_reuse_transform_pass", {}, [], None),
    "split_stages": ("split_stages_transform_pass", {"stages": 2, "balance": "params"}, [], None),
    "emit_verilog": ("emit_verilog_transform_pass", {"out_dir": tempfile.mkdtemp(prefix="fxforge-emit-"),
                                                     "nodes": {"name": ["classifier"]}},
                     [("quantize_transform_pass", FIXED_CLASSIFIER)], None),
}
# transforms with nothing to rewrite in BERT (no complex products, no ReLU / softshrink): run on the AFNO GPT,
# whose FFT mixer has both, so the contract is checked on a graph the pass really changes
GPT_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "afno_real": ("afno_real_arithmetic_transform_pass", {}),
    "mask_free": ("mask_free_activations_transform_pass", {}),
}
GPT_SHAPES = [(2, 16), (3, 24)]


def test_cases_cover_every_transform() -> None:
    transforms = {n for n, fn in PASSES.items() if fn.spec.kind == "transform" and not n.startswith("_")
                  and not fn.module_pass}  # module passes take an nn.Module: tests/passes/test_quant_module.py
    assert {case[0] for case in CASES.values()} | {case[0] for case in GPT_CASES.values()} == transforms


def _common(mg: ForgeGraph) -> dict[str, Any]:
    return {n.name: get_meta(n).common.to_json() for n in mg.model.graph.nodes}


def _fresh(mg: ForgeGraph) -> dict[str, Any]:
    again = mg.copy()
    again, _ = passes.init_metadata_analysis_pass(again)
    again, _ = passes.add_common_metadata_analysis_pass(again)
    return _common(again)


def _outputs(mg: ForgeGraph) -> list[torch.Tensor]:
    with torch.no_grad():
        return [mg(**bert_inputs(labels=False, batch=b, seq=s)).logits for b, s in SHAPES]


@pytest.fixture(scope="module")
def bert_graph() -> ForgeGraph:
    return bert_metadata_graph()


@pytest.mark.parametrize("case", sorted(CASES))
def test_transform_contract_and_metadata(bert_graph: ForgeGraph, case: str) -> None:
    name, args, setup, prepare = CASES[case]
    mg = bert_graph.copy()
    for step, step_args in setup:
        mg, _ = PASSES[step](mg, copy.copy(step_args))
    if prepare is not None:
        prepare(mg)
    # an uncalibrated static quantizer refuses to run: calibration is measured against the float model
    before = _outputs(bert_graph if name == "calibrate_transform_pass" else mg)
    mg, info = PASSES[name](mg, args)
    assert isinstance(info, PASSES[name].spec.info_type)
    after = _outputs(mg)
    contract = PASSES[name].spec.contract
    for ref, out in zip(before, after):
        diff = compare_outputs(ref, out)
        if contract.kind == "exact":
            assert diff.within(contract.atol, contract.rtol), (case, diff)
        else:  # bounded: measured and finite, and the transform did change something
            assert 10.0 < diff.sqnr_db < float("inf"), (case, diff)
    assert _common(mg) == _fresh(mg)


def test_awq_scaling_alone_keeps_bert_outputs(bert_graph: ForgeGraph) -> None:
    """AWQ's input scales (ChannelScale nodes in BERT, whose norms also feed residuals) change nothing until the
    weights are quantized: with every quantizer off the graph equals the float one at both shapes."""
    int4 = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"}}}
    mg, info = passes.awq_transform_pass(bert_graph, {"config": int4, "data": [bert_inputs(labels=False)]})
    assert len(info.layers) == 14 and any(e["alpha"] > 0 for e in info.layers.values())
    for q in passes.quantize.state.quantizers(mg.model).values():
        q.enabled = False
    for ref, out in zip(_outputs(bert_graph), _outputs(mg)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", sorted(GPT_CASES))
def test_transform_contract_and_metadata_on_afno_gpt(case: str) -> None:
    name, args = GPT_CASES[case]
    gen = torch.Generator().manual_seed(4)
    inputs = [torch.randint(0, 64, shape, generator=gen) for shape in GPT_SHAPES]
    mg = ForgeGraph(make_gpt("afno"), example_inputs=(inputs[0],))
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    with torch.no_grad():
        before = [mg(idx) for idx in inputs]
    out, info = PASSES[name](mg, args)
    assert info.changed and out is not mg, (case, info)  # it rewrote something, on a new graph
    contract = PASSES[name].spec.contract
    assert contract.kind == "exact"
    with torch.no_grad():
        for idx, ref in zip(inputs, before):
            diff = compare_outputs(ref, out(idx))
            assert diff.within(contract.atol, contract.rtol), (case, tuple(idx.shape), diff)
    assert _common(out) == _fresh(out)


def test_quantized_gpt_metadata_matches_fresh() -> None:
    """Quantizer nodes inserted around call_function nodes (matmul, softmax, SDPA) get derived metadata."""
    idx = torch.randint(0, 64, (2, 16))
    mg = ForgeGraph(make_gpt("attn"), example_inputs=(idx,))
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    cfg = {"by": "type", "default": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                                "weight_width": 8, "weight_frac_width": 6}}}
    mg, info = passes.quantize_transform_pass(mg, cfg)
    assert info.inserted_quantizer_nodes > 0
    assert _common(mg) == _fresh(mg)
    assert isinstance(mg.model, nn.Module)
