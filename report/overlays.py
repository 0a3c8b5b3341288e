"""Per-node figures the graph view colours by (overlays), read from a ForgeGraph's metadata and modules.

Each overlay is a number per node (or None where it does not apply) plus, for precision, a label: the real
format and widths of a quantized node (``integer w4 in6 b8``), the kernel of a lowered one, else the dtype
of the node's output. Two overlays count zero weights and say which: ``sparsity`` is what pruning removed (the
mask, else zeros of the float weight; none for a layer reloaded from a packed checkpoint, whose stored weight
is its quantized values: low-bit rounding made 77% of a 4-bit tiny BERT's weights 0 there, which read as
pruning), ``zero_codes`` the weights a quantized layer computes with as 0 (rounding and pruning together, the
same live and reloaded). No HTML here: report/hierarchy.py aggregates these per module and
report/graph_view.py draws them. ``OVERLAYS`` lists every overlay with its unit, how a module aggregates its
nodes' values, and whether its colour scale is logarithmic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph.metadata import get_meta, has_meta

__all__ = ["OVERLAYS", "Overlay", "node_precision", "node_values", "sensitivity_by_node"]

SHORT_ROLE = {"data_in": "in", "weight": "w", "bias": "b", "data_out": "out"}


@dataclass(frozen=True)
class Overlay:
    """One colour overlay: ``key`` in the per-node values, its menu title, unit, how a module's value is
    combined from its nodes (``sum``, ``max``, ``min`` or ``weighted``: sparsity by parameter count), log scale,
    and whether larger values are worse (the colour ramp runs towards red)."""

    key: str
    title: str
    unit: str
    combine: str
    log: bool = False
    higher_is_worse: bool = True


OVERLAYS: tuple[Overlay, ...] = (
    Overlay("bits", "precision (bits)", "bits", "min", log=True, higher_is_worse=False),
    Overlay("sparsity", "pruned weights (mask, else zeros of the float weight)", "fraction", "weighted",
            higher_is_worse=False),
    Overlay("zero_codes", "weights quantized to 0 (rounding + pruned)", "fraction", "weighted"),
    Overlay("params", "parameters", "", "sum", log=True),
    Overlay("flops", "FLOPs", "", "sum", log=True),
    Overlay("latency_ms", "measured latency", "ms", "sum", log=True),
    Overlay("memory", "live memory", "bytes", "max", log=True),
    Overlay("sqnr_db", "quantization SQNR", "dB", "min", higher_is_worse=False),
    Overlay("sensitivity", "sensitivity", "loss increase", "max", log=True),
)


def _module(node: fx.Node, root: nn.Module) -> nn.Module | None:
    if node.op != "call_module":
        return None
    try:
        return root.get_submodule(str(node.target))
    except AttributeError:
        return None


def node_precision(node: fx.Node) -> tuple[str, int | None]:
    """(label, bits for the colour scale): quantized format and widths per role, a lowered kernel's
    integer width, else the output's dtype and its bit width; ("", None) without metadata."""
    from ..passes.quantize.records import LoweringRecord, QuantizationRecord

    if not has_meta(node):
        return "", None
    meta = get_meta(node)
    rec = meta.software.get(QuantizationRecord)
    if rec is not None:
        roles = list(rec.quantizers) or [r for r in SHORT_ROLE if isinstance(rec.config.get(f"{r}_width"), int)]
        widths = {r: rec.config[f"{r}_width"] for r in roles if isinstance(rec.config.get(f"{r}_width"), int)}
        label = " ".join([rec.format, *(f"{SHORT_ROLE.get(r, r)}{w}" for r, w in widths.items())])
        lowered = meta.software.get(LoweringRecord)
        if lowered is not None:
            label += f" (lowered: {lowered.kernel}, weight {lowered.weight})"
        bits = widths.get("weight", min(widths.values(), default=None))
        return label, bits
    outs = [v for v in meta.common.results.values() if v.type == "tensor" and v.dtype]
    if not outs:
        return "", None
    dtype = outs[0].dtype or ""  # index and mask tensors (int64, bool) carry no arithmetic precision to colour
    return dtype, (outs[0].precision or (None,))[0] if "float" in dtype else None


def _params(node: fx.Node, root: nn.Module) -> int | None:
    module = _module(node, root)
    if module is not None:
        count = sum(p.numel() for p in module.parameters())
        return count or None
    if node.op == "get_attr":
        obj: Any = root
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj.numel() if isinstance(obj, nn.Parameter) else None
    return None


def _sparsity(node: fx.Node, root: nn.Module) -> tuple[float, int] | None:
    """(pruned fraction, weight elements) of a layer with a 2-D+ weight: zeros of the float weight times its
    pruning mask. None when the layer's weight holds its quantized values (reloaded from a packed checkpoint,
    which stores no float weight and no mask): zeros there are mostly rounding, which ``_zero_codes`` counts."""
    module = _module(node, root)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or weight.is_meta:
        return None
    if getattr(getattr(module, "weight_quantizer", None), "prequantized", False):
        return None
    return _zeros(_masked_weight(module, weight))


def _masked_weight(module: nn.Module | None, weight: torch.Tensor) -> torch.Tensor:
    """The weight with a pruning mask applied (pruned layers multiply by it in their forward)."""
    w = weight.detach()
    mask = getattr(module, "weight_mask", None)
    return w * mask if isinstance(mask, torch.Tensor) and mask.shape == w.shape else w


def _zeros(w: torch.Tensor) -> tuple[float, int]:
    with torch.no_grad():
        return float((w == 0).sum()) / max(w.numel(), 1), w.numel()


def _zero_codes(node: fx.Node, root: nn.Module) -> tuple[float, int] | None:
    """(fraction of the weight whose quantized value is 0, elements) of a quantized layer: its (masked) weight
    through its weight quantizer, as the forward computes with it (a lowered int8 layer: its int8 codes, symmetric,
    so code 0 is value 0). Pruned weights are among them; the sparsity overlay tells them apart."""
    from ..passes.quantize.quantizer import Quantize

    module = _module(node, root)
    codes = getattr(module, "weight_int8", None)
    if isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and codes.dim() >= 2:
        return _zeros(codes)
    weight, q = getattr(module, "weight", None), getattr(module, "weight_quantizer", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or weight.is_meta or not isinstance(q, Quantize) \
            or not q.enabled or q.observer is not None:  # calibrating: a call would record the weight's range
        return None
    try:
        with torch.no_grad():
            quantized = q(_masked_weight(module, weight))
    except Exception:  # noqa: BLE001 - a view must not fail on a quantizer that cannot run yet (uncalibrated)
        return None
    return _zeros(quantized) if isinstance(quantized, torch.Tensor) else None


def node_values(node: fx.Node, root: nn.Module) -> dict[str, float]:
    """Every overlay value this node has (keys of ``OVERLAYS``; ``sparsity_n`` / ``zero_codes_n``: the weights
    those fractions cover)."""
    from ..passes.analysis.liveness import LivenessRecord
    from ..passes.analysis.profile import ProfileRecord

    out: dict[str, float] = {}
    _, bits = node_precision(node)
    if bits is not None:
        out["bits"] = float(bits)
    params = _params(node, root)
    if params:
        out["params"] = float(params)
    for key, measure in (("sparsity", _sparsity), ("zero_codes", _zero_codes)):
        found = measure(node, root)
        if found is not None:
            out[key], out[f"{key}_n"] = found[0], float(found[1])
    if has_meta(node):
        software = get_meta(node).software
        prof = software.get(ProfileRecord)
        if prof is not None:
            out["flops"], out["latency_ms"] = float(prof.flops), float(prof.latency_ms)
        live = software.get(LivenessRecord)
        if live is not None:
            out["memory"] = float(live.bytes + sum(o[2] for o in live.others if len(o) > 2))
    return out


def sensitivity_by_node(sensitivity: Any) -> dict[str, float]:
    """Node name -> loss increase at the narrowest width measured, from a SensitivityInfo, its JSON, or an
    already flat ``{node: value}`` mapping (None: empty)."""
    if sensitivity is None:
        return {}
    to_json = getattr(sensitivity, "to_json", None)
    data = to_json() if callable(to_json) else sensitivity
    if isinstance(data, Mapping) and isinstance(data.get("layers"), list):
        out = {}
        for layer in data["layers"]:
            quant = sorted((p for p in layer.get("quant", []) if len(p) == 2), key=lambda p: p[0])
            if quant:
                out[str(layer["name"])] = float(quant[0][1])
        return out
    if isinstance(data, Mapping):
        return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}
    raise TypeError(f"sensitivity must be a SensitivityInfo, its to_json() or a {{node: value}} mapping, got "
                    f"{type(sensitivity).__name__}")
