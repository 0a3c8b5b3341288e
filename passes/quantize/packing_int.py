"""The "int" codec: integer (MASE fixed point) and scaled_integer weights as ``width``-bit integer codes.

Three ways a code becomes the quantizer's value, each replaying the quantizer's own float32 arithmetic:

* ``fixed``  -- a constant fraction width: ``code / 2.0**frac_width`` (fixed_point_quantize);
* ``pow2``   -- ``frac_width: "auto"``: one fraction width per channel (int8 part ``frac``, shape (C,)) or per
  tensor (shape ()): ``code / torch.pow(2.0, frac)``;
* ``affine`` -- scaled_integer: ``(code - zero_point) * scale`` with float32 ``scale`` (and ``zero_point`` when
  asymmetric) per tensor or per channel; symmetric codes are narrow signed, asymmetric ones unsigned.

Codes are two's complement (unsigned for asymmetric affine) in a little-endian stream of exactly ``width``
bits each (packing_bits); 8-bit signed codes are stored as int8. Integer codes have no NaN and no negative
zero: a weight whose quantized value is NaN is not packable, and ``-0.0`` (a small negative rounded to zero)
reads back as ``+0.0``, equal in value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...graph.packed import Codec, PackedTensor, PartSpec
from .fixed import broadcast_along, integer_range
from .packing_bits import (
    NotPackable,
    all_finite,
    bool_param,
    check_keys,
    flatten_param,
    int_param,
    pack_bits,
    shape_numel,
    stream_bytes,
    unpack_bits,
    unpack_signed,
    view_shape,
)
from .quantizer import Quantize

__all__ = ["INT_CODEC", "pack_int"]

NAME = "int"
MODES: tuple[str, ...] = ("fixed", "pow2", "affine")
KEYS: tuple[str, ...] = ("width", "mode", "frac_width", "axis", "symmetric", "flatten_from")


def _code_range(width: int, mode: str, symmetric: bool | None) -> tuple[int, int]:
    if mode != "affine":
        return integer_range(width)
    return integer_range(width, narrow=True) if symmetric else integer_range(width, signed=False)


def _signed(mode: str, symmetric: bool | None) -> bool:
    return mode != "affine" or bool(symmetric)


def _checked(params: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """The parameters, validated against the logical ``shape`` (ValueError naming the bad one)."""
    where = f"packed codec {NAME!r}"
    check_keys(params, KEYS, where)
    shape_numel(shape, where)
    mode = params["mode"]
    if mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {list(MODES)}, got {mode!r}")
    out: dict[str, Any] = {"mode": mode, "flatten_from": flatten_param(params, shape, where)}
    out["width"] = int_param(params, "width", 2, 16 if mode == "affine" else 32, where)
    view = view_shape(shape, out["flatten_from"])
    out["frac_width"] = int_param(params, "frac_width", -64, 64, where) if mode == "fixed" else None
    out["symmetric"] = bool_param(params, "symmetric", where) if mode == "affine" else None
    for key, used in (("frac_width", mode == "fixed"), ("symmetric", mode == "affine"), ("axis", mode != "fixed")):
        if not used and params[key] is not None:
            raise ValueError(f"{where}: mode {mode!r} takes no {key!r} (must be None), got {params[key]!r}")
    out["axis"] = None if params["axis"] is None else int_param(params, "axis", 0, len(view) - 1, where)
    return out


def parts(params: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, PartSpec]:
    """Each part's dtype and shape, from the parameters and the logical shape alone."""
    p = _checked(params, tuple(shape))
    view = view_shape(tuple(shape), p["flatten_from"])
    n = shape_numel(view, NAME)
    w = p["width"]
    code_dtype = torch.int8 if w == 8 and _signed(p["mode"], p["symmetric"]) else torch.uint8
    out: dict[str, PartSpec] = {"codes": (code_dtype, (stream_bytes(n, w),))}
    per = () if p["axis"] is None else (view[p["axis"]],)
    if p["mode"] == "pow2":
        out["frac"] = (torch.int8, per)
    elif p["mode"] == "affine":
        out["scale"] = (torch.float32, per)
        if not p["symmetric"]:
            out["zero_point"] = (torch.float32, per)
    return out


def _check_parts(packed: PackedTensor) -> dict[str, Any]:
    p = _checked(packed.params, tuple(packed.shape))
    want = parts(packed.params, tuple(packed.shape))
    got = {k: (t.dtype, tuple(t.shape)) for k, t in packed.parts.items()}
    if got != want:
        raise ValueError(f"packed codec {NAME!r}: parts {got} do not match the expected {want}")
    return p


def _check_data(packed: PackedTensor, p: dict[str, Any]) -> None:
    """Refuse scales, zero points and fraction widths the packer never writes (a file's parts are hostile): a
    NaN, infinite, zero or negative scale, a zero point off the integer code range, a fraction width outside
    [-64, 64]; such parts would decode to NaN / inf or to values off the format's grid."""
    where = f"packed codec {NAME!r}"
    if "frac" in packed.parts and packed.parts["frac"].numel() and packed.parts["frac"].abs().max() > 64:
        raise ValueError(f"{where}: fraction widths must be in [-64, 64]")
    scale = packed.parts.get("scale")
    if scale is not None and not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError(f"{where}: scales must be finite and positive")
    zero = packed.parts.get("zero_point")
    if zero is not None:
        lo, hi = _code_range(p["width"], p["mode"], p["symmetric"])
        if not bool(((zero == torch.round(zero)) & (zero >= lo) & (zero <= hi)).all()):
            raise ValueError(f"{where}: zero points must be integers in the code range [{lo}, {hi}]")


def unpack(packed: PackedTensor) -> torch.Tensor:
    """The float32 weight, bit for bit the quantizer's values (up to the sign of zero); ValueError for parts no
    packer writes, or codes and scales whose product is not a finite float32."""
    p = _check_parts(packed)
    _check_data(packed, p)
    view = view_shape(tuple(packed.shape), p["flatten_from"])
    w, mode, axis = p["width"], p["mode"], p["axis"]
    n = shape_numel(view, NAME)
    signed = _signed(mode, p["symmetric"])
    codes = unpack_signed(packed.parts["codes"], n, w) if signed else unpack_bits(packed.parts["codes"], n, w)
    code = codes.to(torch.float32).reshape(view)
    if mode == "fixed":
        out = code / 2.0 ** p["frac_width"]
    elif mode == "pow2":
        frac = packed.parts["frac"].to(torch.float32)
        out = code / torch.pow(2.0, broadcast_along(frac, len(view), axis if axis is not None else 0))
    else:
        scale = packed.parts["scale"]
        zero = packed.parts["zero_point"] if not p["symmetric"] else torch.zeros_like(scale)
        if axis is not None:
            scale, zero = broadcast_along(scale, len(view), axis), broadcast_along(zero, len(view), axis)
        out = (code - zero) * scale
    if not all_finite(out):
        raise ValueError(f"packed codec {NAME!r}: codes times scales overflow float32 (integer codes hold no inf)")
    return out.reshape(packed.shape)


def _codes(c: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Integer-valued float32 codes as integers in [lo, hi] (int8 / int16 when the range fits: pack_bits keeps
    the low bits either way). Above 2^24 float32 rounds ``hi`` up (2^31 - 1 is 2^31): those are clipped as
    int64, and converting the clipped ``hi`` back to float32 rounds it up again, so nothing is lost."""
    if torch.isnan(c).any():
        raise NotPackable("the quantized weight holds NaN (an infinite weight makes a scaled integer's scale "
                          "infinite), which integer codes cannot represent")
    for dtype in (torch.int8, torch.int16):
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:  # exact in float32: clip there, then cast
            return torch.clamp(c, lo, hi).to(dtype)
    return c.to(torch.int64).clamp(lo, hi)


def pack_int(q: Quantize, x: torch.Tensor, ref: torch.Tensor, channel_axis: int, block_axis: int,
             shape: tuple[int, ...], flatten_from: int | None) -> PackedTensor:
    """Codes and scales of ``ref = q(x)`` for an integer / scaled_integer quantizer (``x``: the view it sees).

    Fixed point's codes are ``ref * 2^frac`` (exact: ``ref`` is ``code / 2^frac``, a power-of-two division), so
    the quantizer's rounding is not run again; scaled integers round ``x / scale`` as their quantizer does."""
    p = q.params
    width = int(p["width"])
    if torch.isnan(x).any():
        raise NotPackable(f"{q.fmt.name} weight holds NaN, which integer codes cannot represent")
    params: dict[str, Any] = dict.fromkeys(KEYS)
    params.update(width=width, flatten_from=flatten_from)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if q.fmt.name == "integer" and not q.auto_fixed:
            lo, hi = integer_range(width)
            codes = _codes(ref * 2.0 ** p["frac_width"], lo, hi)
            params.update(mode="fixed", frac_width=int(p["frac_width"]))
        elif q.fmt.name == "integer":
            ctx = q._context(x, channel_axis, block_axis)
            assert ctx.scale is not None  # auto fixed point: _context derives a scale from the weight
            frac = -torch.log2(ctx.scale)
            if not torch.equal(frac, torch.round(frac)) or frac.abs().max() > 64:
                raise NotPackable(f"fraction widths {frac.tolist()} are not integers in [-64, 64]")
            axis = channel_axis if frac.dim() else None
            pow2 = torch.pow(2.0, broadcast_along(frac, x.dim(), channel_axis))
            lo, hi = integer_range(width)
            codes = _codes(ref * pow2, lo, hi)
            params.update(mode="pow2", axis=axis)
            tensors["frac"] = frac.to(torch.int8)
        else:
            ctx = q._context(x, channel_axis, block_axis)
            assert ctx.scale is not None and ctx.zero_point is not None
            symmetric = bool(p["symmetric"])
            axis = channel_axis if q.per_channel else None
            lo, hi = _code_range(width, "affine", symmetric)
            scale, zero = ctx.scale.float(), ctx.zero_point.float()
            sb = broadcast_along(scale, x.dim(), axis) if axis is not None else scale
            zb = broadcast_along(zero, x.dim(), axis) if axis is not None else zero
            codes = _codes(torch.clamp(torch.round(x / sb) + zb, lo, hi), lo, hi)
            params.update(mode="affine", axis=axis, symmetric=symmetric)
            tensors["scale"] = scale.clone()
            if not symmetric:
                tensors["zero_point"] = zero.clone()
    stream = pack_bits(codes, width)
    if width == 8 and _signed(params["mode"], params["symmetric"]):
        stream = stream.view(torch.int8)
    return PackedTensor(NAME, params, shape, {"codes": stream, **tensors})


INT_CODEC = Codec(NAME, parts, unpack)
