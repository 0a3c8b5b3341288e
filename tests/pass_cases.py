"""One table of arguments for every registered pass, so tests can run *all* of them (copy, composition).

A pass registered without an entry here fails those tests on purpose: add how to call it (its args and
the passes that must run first) when you add the pass.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fxforge import ForgeGraph
from fxforge.passes import PASSES

INT8_LINEAR = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8,
                                                   "data_in_dynamic": False, "data_in_symmetric": False,
                                                   "weight_width": 8, "weight_granularity": "per_channel"}}}
MXINT4_LINEAR = {"by": "type", "linear": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}}
# the tiny BERT's classifier alone in fixed point (input, weight, bias, output): a region the Verilog emitter takes
FIXED_CLASSIFIER = {"by": "name", "classifier": {"config": {
    "name": "integer", "data_in_width": 8, "data_in_frac_width": 6, "weight_width": 8, "weight_frac_width": 6,
    "bias_width": 8, "bias_frac_width": 6, "data_out_width": 8, "data_out_frac_width": 4}}}
FIXED_LINEAR = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                                    "weight_width": 8, "weight_frac_width": 6}}}


@dataclass(frozen=True)
class PassCase:
    """How to run a pass on a float graph: ``setup`` passes first, then the pass with ``args(data)``."""

    args: Callable[[list[dict[str, torch.Tensor]]], dict[str, Any] | None]
    setup: tuple[tuple[str, Callable[[list[dict[str, torch.Tensor]]], dict[str, Any] | None]], ...] = ()


def _none(data: list[dict[str, torch.Tensor]]) -> None:
    return None


_QUANTIZE_INT8 = ("quantize_transform_pass", lambda d: INT8_LINEAR)
_CALIBRATE = ("calibrate_transform_pass", lambda d: {"data": d})
_SHAPES = (("init_metadata_analysis_pass", _none), ("add_common_metadata_analysis_pass", _none))
_LORA = ("insert_lora_adapter_transform_pass", lambda d: {"rank": 2})

CASES: dict[str, PassCase] = {
    "init_metadata_analysis_pass": PassCase(_none),
    "add_common_metadata_analysis_pass": PassCase(_none),
    "count_op_analysis_pass": PassCase(_none),
    "report_graph_analysis_pass": PassCase(lambda d: {"show": False}),
    "report_trainable_parameters_analysis_pass": PassCase(lambda d: {"show": False}),
    "remove_dropout_transform_pass": PassCase(_none),
    "freeze_transform_pass": PassCase(lambda d: {"targets": {"type": "embedding"}}),
    "unfreeze_transform_pass": PassCase(lambda d: {"targets": {"type": "embedding"}},
                                        (("freeze_transform_pass", lambda d: {"targets": {"type": "embedding"}}),)),
    "insert_lora_adapter_transform_pass": PassCase(lambda d: {"rank": 2}),
    "fuse_lora_weights_transform_pass": PassCase(_none, (_LORA,)),
    "quantize_transform_pass": PassCase(lambda d: FIXED_LINEAR),
    "calculate_avg_bits_module_analysis_pass": PassCase(_none, (("quantize_transform_pass", lambda d: FIXED_LINEAR),)),
    "calibrate_transform_pass": PassCase(lambda d: {"data": d}, (_QUANTIZE_INT8,)),
    "gptq_transform_pass": PassCase(lambda d: {"config": FIXED_LINEAR, "data": d}),
    "awq_transform_pass": PassCase(lambda d: {"config": FIXED_LINEAR, "data": d}),
    "rotate_hadamard_transform_pass": PassCase(_none),  # no RMSNorm decoder in BERT: left as it is (test_rotation)
    "quantization_report_analysis_pass": PassCase(lambda d: {"data": d}, (_QUANTIZE_INT8, _CALIBRATE)),
    "lower_int8_transform_pass": PassCase(_none, (_QUANTIZE_INT8, _CALIBRATE)),
    "lower_weight_only_transform_pass": PassCase(_none, (("quantize_transform_pass", lambda d: MXINT4_LINEAR),)),
    "causality_analysis_pass": PassCase(lambda d: {"jacobian_len": 4, "positions": [3]}),
    "profile_analysis_pass": PassCase(lambda d: {"runs": 1}, (("init_metadata_analysis_pass", _none),)),
    "liveness_analysis_pass": PassCase(_none, (("init_metadata_analysis_pass", _none),)),
    "buffer_reuse_transform_pass": PassCase(_none),
    "sensitivity_analysis_pass": PassCase(lambda d: {"data": d, "method": "sqnr", "widths": [4], "prune_ratios": [.5]}),
    # mild, so a composition stays within its tolerance of the unpruned model
    "prune_transform_pass": PassCase(lambda d: {"weight": {"sparsity": 0.02}}),
    "shrink_transform_pass": PassCase(_none, (("prune_transform_pass", lambda d: {  # 1 FFN unit per layer
        "weight": {"sparsity": 0.02, "granularity": "ffn"}}),)),
    "conv_bn_fusion_transform_pass": PassCase(_none),
    "add_movement_metadata_analysis_pass": PassCase(_none, (("init_metadata_analysis_pass", _none),)),
    "add_natural_sparsity_metadata_analysis_pass": PassCase(lambda d: {"data": d},
                                                            (("init_metadata_analysis_pass", _none),)),
    "prune_detach_hook_analysis_pass": PassCase(_none),
    "hook_inspection_analysis_pass": PassCase(_none),
    "attention_swap_transform_pass": PassCase(lambda d: {"kv_heads": 1}, _SHAPES),
    "cse_transform_pass": PassCase(_none),
    "dce_transform_pass": PassCase(_none),
    "hoist_parameter_subgraphs_transform_pass": PassCase(_none),
    "batch_matmuls_transform_pass": PassCase(_none),
    "fuse_elementwise_transform_pass": PassCase(_none),
    "fold_constants_transform_pass": PassCase(_none),
    "fuse_kernels_transform_pass": PassCase(_none, _SHAPES),
    "afno_real_arithmetic_transform_pass": PassCase(_none, _SHAPES),
    "mask_free_activations_transform_pass": PassCase(_none),
    "activation_checkpoint_transform_pass": PassCase(lambda d: {"fraction": 0.9}),
    "split_stages_transform_pass": PassCase(lambda d: {"stages": 2, "balance": "params"},
                                            (("init_metadata_analysis_pass", _none),)),
    "emit_verilog_transform_pass": PassCase(
        lambda d: {"out_dir": tempfile.mkdtemp(prefix="fxforge-emit-"), "nodes": {"name": ["classifier"]}},
        (("quantize_transform_pass", lambda d: FIXED_CLASSIFIER),)),
    "hardware_estimate_analysis_pass": PassCase(lambda d: {"nodes": {"name": ["classifier"]}},
                                                (("quantize_transform_pass", lambda d: FIXED_CLASSIFIER),)),
    "add_software_metadata_analysis_pass": PassCase(_none, _SHAPES),
    "verify_common_metadata_analysis_pass": PassCase(lambda d: {"raise_on_mismatch": False}, _SHAPES),
    "verify_software_metadata_analysis_pass": PassCase(_none, (("init_metadata_analysis_pass", _none),)),
    "verify_metadata_analysis_pass": PassCase(lambda d: {"raise_on_mismatch": False}, _SHAPES),
    "report_node_type_analysis_pass": PassCase(lambda d: {"show": False}, _SHAPES),
    "report_node_shape_analysis_pass": PassCase(lambda d: {"show": False}, _SHAPES),
    "report_node_meta_param_analysis_pass": PassCase(lambda d: {"show": False}, _SHAPES),
    "profile_statistics_analysis_pass": PassCase(lambda d: {"target_weight_nodes": ["linear"], "data": d,
                                                            "target_activation_nodes": ["linear"]},
                                                 (("init_metadata_analysis_pass", _none),)),
}


def case(name: str) -> PassCase:
    """The table entry of a registered pass; a clear failure when a new pass has none."""
    if name not in CASES:
        raise AssertionError(f"pass {name!r} is registered but tests/pass_cases.py has no entry for it: add "
                             "its args (and the passes it needs first) so copy/composition tests cover it")
    return CASES[name]


def run_case(graph: ForgeGraph, name: str, data: list[dict[str, torch.Tensor]],
             setup: bool = True) -> tuple[ForgeGraph, Any]:
    """Run ``name`` (after its setup passes when ``setup``) on ``graph``; returns the new graph and the pass's
    info (a transform leaves ``graph`` as it was)."""
    c = case(name)
    if setup:
        for pre, args in c.setup:
            graph, _ = PASSES[pre](graph, args(data))
    return PASSES[name](graph, c.args(data))


def registered(kind: str | None = None) -> list[str]:
    """fxforge's registered graph pass names (of one kind), sorted; passes that tests register, and module passes
    (they take a plain nn.Module: tests/passes/test_quant_module.py), are left out."""
    return sorted(n for n, fn in PASSES.items() if (kind is None or fn.pass_kind == kind)  # type: ignore[attr-defined]
                  and fn.__module__.startswith("fxforge.") and not fn.module_pass)
