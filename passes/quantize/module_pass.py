"""Quantization of a plain nn.Module (MASE's module passes), for models that cannot be captured.

``quantize_module_transform_pass(model, config)`` takes the same MASE config as ``quantize_transform_pass``
(``by: type / name / regex``, the same formats) and swaps the same quantized layers in, by module path and
type, through the same decision (``layer_swap.plan_layer_swap``): Linear, Conv1d/2d, LayerNorm, Embedding,
wrapped layers (LoRA) and fxforge's ScaledDotProductAttention modules. What only a graph can reach (a
``torch.matmul`` or ``F.softmax`` called inside a forward, activation modules the graph pass wraps with
quantizers) is left float and listed in ``info.not_reached``.

``calculate_avg_bits_module_analysis_pass`` reports the average weight width over the quantized layers of a
model or graph (MASE's ``average_bitwidth``; 32 when nothing is quantized).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import module_op_name
from ..base import NoArgs, PassArgsError, forge_pass
from ..contract import NumericalContract, PassInfo
from .config import QUANTIZABLE_OPS, QuantizeConfig
from .layer_swap import SDPA, plan_layer_swap
from .modules import QUANTIZED_LAYERS
from .quantizer import Quantize

__all__ = ["AvgBitsInfo", "QuantizeModuleInfo", "calculate_avg_bits_module_analysis_pass",
           "quantize_module_transform_pass"]


@dataclass(frozen=True)
class QuantizeModuleInfo(PassInfo):
    """quantized_modules: module paths swapped for quantized ones; by_op: count per canonical op;
    float_adapters: wrappers (LoRA) whose wrapped layer was quantized; not_reached: modules a rule selects
    whose op only the graph pass quantizes (quantizers around a node), left float here."""

    quantized_modules: list[str] = field(default_factory=list)
    by_op: dict[str, int] = field(default_factory=dict)
    float_adapters: list[str] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent_path) if parent_path else root, leaf, module)


@forge_pass("transform", QuantizeConfig, info=QuantizeModuleInfo, module_pass=True,
            contract=NumericalContract("bounded", note="simulated quantization, as quantize_transform_pass"))
def quantize_module_transform_pass(model: nn.Module, args: QuantizeConfig) -> tuple[nn.Module, QuantizeModuleInfo]:
    """Quantize the layers of ``model`` (a copy; ``apply_inplace`` changes ``model``) with a MASE config.

    Module paths are the names the config's ``by: name`` / ``regex`` keys match, as in the graph pass. A module
    shared by several paths is swapped once (every path then holds the same quantized layer).
    """
    if args.default is None and all(c is None for _, c in args.rules):
        raise PassArgsError("quantize_module_transform_pass: the config selects no format (the default and every "
                            "entry have name None); give e.g. {'linear': {'config': {'name': 'integer', ...}}}")
    done = [n for n, m in model.named_modules() if n and isinstance(m, tuple(QUANTIZED_LAYERS.values()))]
    if done or any(isinstance(m, Quantize) for m in model.modules()):
        raise ValueError(f"the model is already quantized ({done[:3] or 'Quantize modules'}); quantize the float "
                         "model once (keep a copy.deepcopy of it to try another config)")
    used: set[str] = set()
    by_op: dict[str, int] = {}
    swapped: dict[int, nn.Module] = {}  # id(old module) -> its quantized replacement
    paths: list[str] = []
    adapters: list[str] = []
    not_reached: list[str] = []
    skip: tuple[str, ...] = ()  # paths below a swapped module or a module that was planned (its own children)
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not name or (skip and name.startswith(skip)):
            continue
        op = module_op_name(module)
        handled, rules, swap = plan_layer_swap(name, module, op, args, f"module {name!r}")
        used.update(rules)
        if not handled:
            if op in (*QUANTIZABLE_OPS, SDPA) and len(list(module.children())) == 0:
                rule, cfg = args.rule_for(name, op, module)
                used.update([rule] if rule is not None else [])
                if cfg is not None:
                    not_reached.append(name)
            continue
        skip = (*skip, f"{name}.")
        if swap is None:
            continue
        if id(module) not in swapped:
            swapped[id(module)] = swap.build(module)
        _set(model, name, swapped[id(module)])
        paths.append(name)
        by_op[swap.op] = by_op.get(swap.op, 0) + 1
        if swap.wrapped is not None:
            adapters.append(name)
    if args.by != "type":
        unused = [k for k, _ in args.rules if k not in used]
        if unused:
            layers = [n for n, m in model.named_modules() if module_op_name(m) in QUANTIZABLE_OPS][:8]
            raise PassArgsError(f"quantize_module_transform_pass: by={args.by!r} key(s) {unused} matched no "
                                f"quantizable module; quantizable modules include {layers}")
    return model, QuantizeModuleInfo(quantized_modules=paths, by_op=by_op, float_adapters=adapters,
                                     not_reached=not_reached, changed=bool(paths))


@dataclass(frozen=True)
class AvgBitsInfo(PassInfo):
    """average_bitwidth: weight bits per weight value over the quantized layers (MASE's key; 32.0 when none
    is quantized); weight_values: values counted; weight_bits: their total bits; layers: layers counted."""

    average_bitwidth: float = 32.0
    weight_values: int = 0
    weight_bits: float = 0.0
    layers: int = 0


@forge_pass("analysis", NoArgs, info=AvgBitsInfo, accepts_module=True)
def calculate_avg_bits_module_analysis_pass(model: nn.Module | ForgeGraph, args: NoArgs
                                            ) -> tuple[nn.Module | ForgeGraph, AvgBitsInfo]:
    """Average weight bit width of the layers whose weight is quantized (each format's bits per value,
    block scales included), for a model quantized by module or a quantized graph; changes nothing."""
    root = model.model if isinstance(model, ForgeGraph) else model
    values, bits, layers = 0, 0.0, 0
    seen: set[int] = set()
    for module in root.modules():
        q = getattr(module, "weight_quantizer", None)
        weight = getattr(module, "weight", None)
        if not isinstance(q, Quantize) or weight is None or id(module) in seen:
            continue
        seen.add(id(module))
        values += weight.numel()
        bits += weight.numel() * q.spec.bits
        layers += 1
    average = bits / values if values else 32.0
    return model, AvgBitsInfo(average_bitwidth=average, weight_values=values, weight_bits=bits, layers=layers)
