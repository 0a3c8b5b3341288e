"""A simulated quantized weight as integer codes times scales, and the CPU kernel that computes it exactly.

The weight-only lowering needs, per layer, integer codes ``q`` and scales ``s`` with ``q * s`` *equal* to the
weight the simulation multiplies by. They are derived the way each format's quantizer derives them (per-row
power-of-two scales for fixed point, symmetric per-row/per-tensor scales for scaled integers, one power-of-two
step per block for MXINT / block floating point) and then checked against the simulated weight element by
element; a layer whose check fails stays simulated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .block import _blocked, _floor_log2_amax
from .fixed import auto_frac_width, scale_zero_point, tensor_range
from .formats import AUTO
from .minifloat import pow2
from .woq_modules import INT4_GROUP_SIZES

__all__ = ["WeightCodes", "simulated_weight", "weight_codes", "pick_kernel"]


@dataclass(frozen=True)
class WeightCodes:
    """``codes`` [N, K] (int32, signed) times ``scale`` [N, K // group] (fp32, one per group of a row) is the
    simulated weight; ``pow2``: every scale is a power of two; ``bits``: the signed width the codes need."""

    codes: torch.Tensor
    scale: torch.Tensor
    group: int
    pow2: bool
    bits: int
    format: str

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(self.group, dim=1)


def _masked(layer: nn.Module, name: str) -> torch.Tensor | None:
    """``layer``'s weight / bias as its forward reads it (a pruned layer's masked tensor)."""
    masked = getattr(layer, f"masked_{name}", None)
    value = masked() if callable(masked) else getattr(layer, name, None)
    return None if value is None else value.detach()


def simulated_weight(layer: nn.Module) -> torch.Tensor:
    """The weight a quantized layer's forward multiplies by (its quantizer applied to its float weight)."""
    w = _masked(layer, "weight")
    assert w is not None
    q = getattr(layer, "weight_quantizer", None)
    with torch.no_grad():
        return (w if q is None else q(w)).float()


def simulated_bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias a quantized layer's forward adds (quantized when the config quantizes it)."""
    b = _masked(layer, "bias")
    q = getattr(layer, "bias_quantizer", None)
    with torch.no_grad():
        return None if b is None else (b if q is None else q(b)).float()


def _row_scales(fmt: str, p: dict, w: torch.Tensor) -> tuple[torch.Tensor, bool] | str:
    """Per-row scales [N, 1] and whether they are powers of two, or why the format has none."""
    if fmt == "integer":
        if p["frac_width"] == AUTO:  # the quantizer's per-row choice for a weight matrix
            lo, hi = tensor_range(w, 0)
            frac = auto_frac_width(torch.maximum(lo.abs(), hi.abs()), p["width"])
        else:
            frac = torch.full((w.shape[0],), float(p["frac_width"]))
        return torch.pow(2.0, -frac).reshape(-1, 1), True
    if fmt == "scaled_integer":
        if not p["symmetric"]:
            return "asymmetric scaled_integer weights have zero points (weight-only kernels take symmetric codes)"
        lo, hi = tensor_range(w, 0 if p["granularity"] == "per_channel" else None)
        scale, _ = scale_zero_point(lo, hi, p["width"], symmetric=True)
        return scale.expand(w.shape[0]).reshape(-1, 1).float(), False
    return f"format {fmt} has no per-row integer scale"


def _block_scales(fmt: str, p: dict, w: torch.Tensor) -> torch.Tensor | str:
    """Per-block power-of-two steps [N, K // block] of an MXINT / block_fp weight (blocks along the input)."""
    block = p["block_size"]
    if w.shape[1] % block:
        return f"{fmt} block_size {block} does not divide in_features {w.shape[1]} (a partial block)"
    bias = 127 if fmt == "mxint" else (2 ** (p["exponent_width"] - 1) - 1 if p["exponent_bias"] is None
                                       else p["exponent_bias"])
    ew = 8 if fmt == "mxint" else p["exponent_width"]
    blocks, _, _ = _blocked(w.float(), block, -1)
    e = torch.clamp(_floor_log2_amax(blocks), max(-bias, -126), min(2**ew - 1 - bias, 127))
    return (pow2(e, torch.float32) / 2.0 ** (p["width"] - 2)).squeeze(-1)


def weight_codes(layer: nn.Module) -> WeightCodes | str:
    """The integer codes and scales of a QuantizedLinear / QuantizedEmbedding weight, or why there are none."""
    q = getattr(layer, "weight_quantizer", None)
    if q is None:
        return "weight is not quantized"
    fmt, p = q.spec.format, q.params
    w = _masked(layer, "weight")
    assert w is not None
    w = w.float()
    if w.dim() != 2:
        return f"weight is {w.dim()}-d (weight-only kernels take a 2-d matrix)"
    if fmt in ("integer", "scaled_integer"):
        rows = _row_scales(fmt, p, w)
        if isinstance(rows, str):
            return rows
        scale, is_pow2, group = rows[0], rows[1], w.shape[1]
    elif fmt in ("mxint", "block_fp"):
        blocks = _block_scales(fmt, p, w)
        if isinstance(blocks, str):
            return blocks
        scale, is_pow2, group = blocks, True, p["block_size"]
    else:
        return f"{fmt} elements are not integers (no exact integer weight-only kernel)"
    wq = simulated_weight(layer)
    full = scale.repeat_interleave(group, dim=1)
    codes = torch.round(wq / full)
    if not torch.equal(codes * full, wq) or not torch.isfinite(codes).all():
        return f"{fmt} codes times scales do not reproduce the simulated weight (e.g. non-finite or subnormal)"
    hi, lo = (int(codes.max()), int(codes.min())) if codes.numel() else (0, 0)
    bits = max(2, hi.bit_length() + 1, (-lo - 1).bit_length() + 1)  # signed: [-2^(b-1), 2^(b-1) - 1]
    return WeightCodes(codes.to(torch.int32), scale.float(), group, is_pow2, bits, fmt)


def _bf16_exact(t: torch.Tensor) -> bool:
    """Every value survives bf16 (a normal power of two does; subnormals below 2^-126 may not)."""
    return bool(torch.equal(t.to(torch.bfloat16).float(), t)) and bool((t.abs() >= 2.0**-126).all())


def pick_kernel(wc: WeightCodes, out_features: int, in_features: int) -> tuple[str, int] | str:
    """``("int4", group)``, ``("int8", 0)`` or ``("group", group)`` (a bf16 GEMM on the weight decoded exactly):
    the exact weight-only kernel for ``wc``, or why none is."""
    int4_why = ""
    if wc.bits <= 4 and wc.pow2:
        group = wc.group if wc.group != in_features else \
            next((g for g in reversed(INT4_GROUP_SIZES) if in_features % g == 0), 0)
        if group not in INT4_GROUP_SIZES or in_features % group:
            int4_why = f"int4 group {wc.group} is not one of {list(INT4_GROUP_SIZES)} dividing in_features"
        elif out_features % 16:
            int4_why = f"out_features {out_features} is not a multiple of 16 (the int4 pack's row blocks)"
        elif not _bf16_exact(wc.scale):
            int4_why = "int4 scales are not exact in bf16 (below 2^-126)"
        else:
            return "int4", group
    if wc.group == in_features and wc.bits <= 8:
        return "int8", 0
    if wc.bits <= 8 and wc.pow2 and in_features % wc.group == 0 and _bf16_exact(wc.scale):
        return "group", wc.group
    why = int4_why or (f"{wc.bits}-bit codes with " + ("power-of-two" if wc.pow2 else "non-power-of-two")
                       + f" scales per group of {wc.group}")
    return f"no exact weight-only kernel: {why} (int4 needs <= 4-bit codes and power-of-two scales per group of "\
           f"32-256 inputs; int8 needs <= 8-bit codes and one scale per row; the bf16 group path <= 8-bit codes "\
           f"and normal power-of-two scales per group)"
