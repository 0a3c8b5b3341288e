"""Real low-bit kernels for simulated quantized layers whose format one computes exactly.

``lower_weight_only_transform_pass`` replaces, layer by layer:

* linears with 8-bit scaled-integer activations (dynamic or calibrated) and int8 symmetric weights by the
  existing :class:`Int8Linear` (``lower.py``: int8 x int8 GEMMs);
* linears with float activations whose weight is integer codes times power-of-two scales per group of
  32-256 inputs (MXINT4 / block_fp with width <= 4 and block 32/64/128/256, fixed point width <= 4 with one
  power-of-two scale per row) by :class:`WeightOnlyInt4Linear` (ATen int4 pack, bf16 activations);
* other float-activation linears whose weight has <= 8-bit codes and one scale per row (fixed point width
  <= 8 with a fixed or automatic fraction width, symmetric scaled integers per channel or per tensor) by
  :class:`WeightOnlyInt8Linear` (``fxforge.kernels.woq_int8``);
* the remaining float-activation linears with <= 8-bit codes and power-of-two scales per group (MXINT /
  block_fp at widths 5-8, or 4-bit ones the int4 pack refuses) by :class:`WeightOnlyGroupLinear`
  (``woq_group``: a bf16 GEMM on the weight decoded exactly, since such a weight is exact in bf16);
* embeddings with <= 8-bit codes and row-local scales by :class:`WeightOnlyEmbedding` (``embeddings``).

Every other quantized layer stays simulated and ``info.skipped`` says why (format, width, granularity).
The lowered weight equals the simulated one exactly; outputs differ only by rounding, bounded per layer
by each module's ``error_bound`` (fp32 summation order for int8; plus bf16 rounding of the activations
and outputs for int4 and the group path: about 2^-7 relative to ``|x| @ |W|.T + |b|``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import get_meta
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import inject_modules
from ..select import iter_layers
from .int8_input import static_input_range
from .lower import Int8Linear, int8_kernel_saturates, lowerable, onednn_available
from .modules import QuantizedEmbedding, QuantizedLinear, _QuantizedLayer
from .records import LoweringRecord
from .state import quantized_nodes
from .woq_codes import pick_kernel, simulated_bias, weight_codes
from .woq_group import WeightOnlyGroupLinear
from .woq_modules import WeightOnlyEmbedding, WeightOnlyInt4Linear, WeightOnlyInt8Linear, resident_bytes

__all__ = ["lower_weight_only_transform_pass", "LowerWeightOnlyArgs", "LowerWeightOnlyInfo", "lowering_plan",
           "WEIGHT_ONLY_LAYERS"]

WEIGHT_ONLY_LAYERS: tuple[type[nn.Module], ...] = (WeightOnlyInt8Linear, WeightOnlyInt4Linear, WeightOnlyGroupLinear,
                                                   WeightOnlyEmbedding)
_LOWERED = (*WEIGHT_ONLY_LAYERS, Int8Linear)

register_property("weight-only-lowered", lambda graph: any(True for _ in iter_layers(graph.model, _LOWERED)),
                  "a layer runs on a real low-bit kernel (lower_weight_only_transform_pass)")


@dataclass(frozen=True)
class LowerWeightOnlyArgs:
    """int4 / int8 / group: lower float-activation linears to those kernels (group: <= 8-bit codes with
    power-of-two scales per group, a bf16 GEMM); dynamic_int8: linears with 8-bit scaled-integer activations
    to Int8Linear (``backend`` as lower_int8_transform_pass's); embeddings: quantized embedding tables to
    WeightOnlyEmbedding; strict: error if any quantized layer stays simulated."""

    int4: bool = True
    int8: bool = True
    group: bool = True
    dynamic_int8: bool = True
    embeddings: bool = True
    backend: Literal["auto", "onednn", "fbgemm"] = "auto"
    strict: bool = False


@dataclass(frozen=True)
class LowerWeightOnlyInfo(PassInfo):
    """lowered: layer path -> kernel it now runs on; skipped: path -> why it stays simulated (format, width,
    granularity); resident_bytes: parameter + buffer bytes of the lowered layers (codes, scales, biases)."""

    lowered: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    resident_bytes: int = 0


def _describe(layer: nn.Module) -> str:
    """``format(width=.., granularity=..)`` of a layer's weight, for skip reasons."""
    q = getattr(layer, "weight_quantizer", None)
    if q is None:
        return "weight not quantized"
    keys = ("width", "frac_width", "granularity", "symmetric", "block_size", "exponent_width")
    return f"{q.spec.format}({', '.join(f'{k}={q.params[k]}' for k in keys if k in q.params)})"


def _activation_int8(layer: QuantizedLinear) -> bool:
    """The config asks for 8-bit scaled-integer activations (the Int8Linear path)."""
    x = layer.quant.role("data_in")
    return x is not None and x.format == "scaled_integer" and x.p["width"] == 8


def _embedding_plan(layer: QuantizedEmbedding, args: LowerWeightOnlyArgs) -> str:
    if not args.embeddings:
        return "skip: embeddings=False"
    if layer.max_norm is not None:
        return "skip: max_norm renormalises rows at lookup (the codes would change)"
    wc = weight_codes(layer)
    if isinstance(wc, str):
        return f"skip: {wc}"
    if wc.bits > 8:
        return f"skip: {wc.bits}-bit codes (WeightOnlyEmbedding stores 4- or 8-bit codes)"
    width = 4 if wc.bits <= 4 and layer.embedding_dim % 2 == 0 else 8
    return f"embedding int{width} block {wc.group}"


def _linear_plan(layer: QuantizedLinear, args: LowerWeightOnlyArgs) -> str:
    """``int8-dynamic`` | ``int4 g<G>`` | ``int8`` | ``group g<G>`` | ``skip: <why>`` for one quantized linear."""
    if getattr(layer, "act_sparsity", 0.0) > 0:
        return "skip: it prunes its input at run time (activation pruning from prune_transform_pass)"
    if layer.quant.role("data_out") is not None:
        return "skip: data_out is quantized (the kernels return float outputs)"
    if _activation_int8(layer):
        why = lowerable(layer)
        if why is not None:
            return f"skip: 8-bit activations need Int8Linear, which refuses: {why}"
        return "int8-dynamic" if args.dynamic_int8 else "skip: dynamic_int8=False"
    x = layer.quant.role("data_in")
    if x is not None:
        return (f"skip: data_in is quantized to {x.format}(width={x.p.get('width')}) (weight-only kernels take "
                "float activations; 8-bit scaled_integer activations take the int8 x int8 path)")
    wc = weight_codes(layer)
    if isinstance(wc, str):
        return f"skip: {wc}"
    kernel = pick_kernel(wc, layer.out_features, layer.in_features)
    if isinstance(kernel, str):
        return f"skip: {kernel}"
    if kernel[0] == "int4" and args.int4:
        return f"int4 g{kernel[1]}"
    if wc.group == layer.in_features and wc.bits <= 8 and args.int8:
        return "int8"
    if kernel[0] == "group" and args.group:
        return f"group g{kernel[1]}"
    return f"skip: int4={args.int4}, int8={args.int8}, group={args.group} leave no kernel for it"


def lowering_plan(graph: ForgeGraph, args: LowerWeightOnlyArgs | None = None) -> dict[str, str]:
    """Per quantized linear / embedding path: the kernel it would be lowered to, or ``skip: <why>``."""
    args = args or LowerWeightOnlyArgs()
    gm = graph.model
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    plan: dict[str, str] = {}
    for name, module in gm.named_modules():
        if isinstance(module, _QuantizedLayer) and not isinstance(module, QuantizedLinear | QuantizedEmbedding):
            plan[name] = f"skip: {_describe(module)}: {type(module).__name__} has no weight-only kernel here " \
                         "(linear and embedding layers only)"
            continue
        if not isinstance(module, QuantizedLinear | QuantizedEmbedding):
            continue
        if name not in called:
            plan[name] = ("skip: wrapped by another module (a LoRA adapter from insert_lora_adapter_transform_pass): "
                          "fuse it first with fuse_lora_weights_transform_pass")
        elif isinstance(module, QuantizedEmbedding):
            plan[name] = _embedding_plan(module, args)
        else:
            plan[name] = _linear_plan(module, args)
        if plan[name].startswith("skip: ") and not plan[name].startswith("skip: wrapped"):
            plan[name] = f"skip: {_describe(module)}: {plan[name][6:]}"
    return plan


def _build(name: str, module: nn.Module, how: str, backend: str) -> nn.Module:
    if how == "int8-dynamic":
        assert isinstance(module, QuantizedLinear)
        w = module.quant.role("weight")
        assert w is not None
        return Int8Linear.from_linear(module, w.p["granularity"] == "per_channel", backend, False,
                                      static_input_range(module) if backend == "onednn" else None)
    wc = weight_codes(module)
    assert not isinstance(wc, str), (name, wc)
    if isinstance(module, QuantizedEmbedding):
        width = int(how.split()[1][3:])
        return WeightOnlyEmbedding.from_codes(wc.codes, wc.scale, width, module.padding_idx)
    bias = simulated_bias(module)
    if how.startswith("int4"):
        group = int(how.split()[1][1:])
        scale = wc.scale if wc.group == group else wc.scale.expand(-1, wc.codes.shape[1] // group)
        return WeightOnlyInt4Linear.from_codes(wc.codes, scale, group, bias)
    if how.startswith("group"):
        return WeightOnlyGroupLinear.from_codes(wc.codes, wc.scale, wc.group, max(wc.bits, 2), bias)
    return WeightOnlyInt8Linear.from_codes(wc.codes, wc.scale.reshape(-1), bias)


_KERNELS = {"int4": "aten._weight_int4pack_mm_for_cpu (bf16 activations)",
            "group": "bf16 GEMM on the weight decoded exactly from its codes for each call",
            "int8": "fxforge.kernels.woq_int8.int8_weight_only_linear (fp32 activations)",
            "embedding": "gather codes + scales, dequantize the gathered rows"}


def _record(how: str, backend: str, static: bool) -> LoweringRecord:
    if how == "int8-dynamic":
        kernel = "onednn::qlinear_pointwise" if backend == "onednn" else "quantized::linear_dynamic"
        activation = "uint8 per-tensor " + ("static (calibrated)" if static else "dynamic")
        if int8_kernel_saturates(backend):
            activation += ", 7-bit codes (this CPU's int8 kernel saturates 8-bit)"
        return LoweringRecord(kernel=kernel, activation=activation)
    kind, *rest = how.split()
    if kind == "int4":
        weight = f"int4 codes, bf16 power-of-two scale per group of {rest[0][1:]}"
    elif kind == "group":
        weight = f"<= 8-bit codes (int8), fp32 power-of-two scale per group of {rest[0][1:]}"
    elif kind == "int8":
        weight = "int8 codes, fp32 scale per row"
    else:
        weight = f"{rest[0]} codes, fp32 scale per block of {rest[-1]}"
    activation = {"int4": "bf16 (rounded from fp32)", "group": "bf16 (rounded from fp32)", "int8": "fp32",
                  "embedding": "int64 indices"}[kind]
    return LoweringRecord(kernel=_KERNELS[kind], weight=weight, activation=activation)


@forge_pass("transform", LowerWeightOnlyArgs, info=LowerWeightOnlyInfo, requires=("quantized",),
            ensures=("weight-only-lowered",),
            contract=NumericalContract(
                "bounded", min_sqnr_db=20.0,
                note="weights equal the simulated ones exactly; per layer |lowered - simulated| <= tol * "
                     "(|x| @ |W|.T + |b|) with tol = (2K + 4) * 2^-24 for int8 weight-only (fp32 summation "
                     "order), 2^-7 + (2K + 4) * 2^-24 for int4 and the group path (bf16 activations and outputs); "
                     "embeddings exact; "
                     "8-bit-activation layers as lower_int8_transform_pass (activation rounding)"))
def lower_weight_only_transform_pass(graph: ForgeGraph,
                                     args: LowerWeightOnlyArgs) -> tuple[ForgeGraph, LowerWeightOnlyInfo]:
    """Swap every simulated quantized linear / embedding whose format has an exact CPU kernel for it."""
    backend = args.backend if args.backend != "auto" else ("onednn" if onednn_available() else "fbgemm")
    if backend == "onednn" and not onednn_available():
        raise ValueError("backend 'onednn' is not available in this torch build; use 'fbgemm'")
    plan = lowering_plan(graph, args)
    skipped = {k: v[6:] for k, v in plan.items() if v.startswith("skip: ")}
    if skipped and args.strict:
        raise ValueError(f"{len(skipped)} quantized layer(s) have no exact kernel and would stay simulated: "
                         f"{skipped}; pass strict=False to lower the rest")
    if len(skipped) == len(plan):
        why = "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:3])
        raise ValueError(
            "no simulated quantized linear or embedding has an exact low-bit kernel"
            + (f" ({len(plan)} stay simulated, e.g. {why})" if plan else
               " (none is left: lower_int8_transform_pass or this pass may have lowered them already)")
            + "; run it on a graph from quantize_transform_pass with integer / scaled_integer / mxint weights "
              "(see lowering_plan)")
    gm = graph.model
    static = {name: static_input_range(m) is not None and backend == "onednn"
              for name, m in gm.named_modules() if plan.get(name) == "int8-dynamic" and isinstance(m, QuantizedLinear)}

    def build(name: str, module: nn.Module) -> nn.Module | None:
        how = plan.get(name, "skip: ")
        return None if how.startswith("skip: ") else _build(name, module, how, backend)

    inject_modules(gm, {"type": [QuantizedLinear, QuantizedEmbedding]}, None, build,
                   what="quantized linear or embedding with an exact low-bit kernel (see lowering_plan)")
    lowered = {k: v for k, v in plan.items() if not v.startswith("skip: ")}
    for node, rec in quantized_nodes(gm):
        name = str(node.target)
        if node.op == "call_module" and name in lowered:
            get_meta(node).software.set(_record(lowered[name], backend, static.get(name, False)))
            rec.quantizers = {}  # the simulated quantizers are gone; the config stays as provenance
    resident = sum(resident_bytes(gm.get_submodule(name)) for name in lowered)
    return graph, LowerWeightOnlyInfo(lowered=lowered, skipped=skipped, resident_bytes=resident)
