"""The "minifloat" codec: a minifloat weight stored as its bit patterns (sign, biased exponent, mantissa).

``minifloat_codes`` / ``minifloat_values`` convert between float32 values that lie on a format's grid and
their ``1 + E + M``-bit patterns, exactly: the sign of zero, subnormals, +-inf (``special`` "ieee") and NaN
(all-ones exponent and mantissa, with its sign) round-trip. The MXFP codec (packing_block) stores its
elements with the same two functions.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ...graph.packed import Codec, PackedTensor, PartSpec
from .minifloat import SPECIALS, MinifloatFormat
from .minifloat import pow2 as _pow2
from .packing_bits import (
    NotPackable,
    check_keys,
    flatten_param,
    int_param,
    pack_bits,
    shape_numel,
    stream_bytes,
    unpack_bits,
    view_shape,
)
from .quantizer import Quantize

__all__ = ["MINIFLOAT_CODEC", "minifloat_codes", "minifloat_values", "pack_minifloat"]

NAME = "minifloat"
KEYS: tuple[str, ...] = ("width", "exponent_width", "exponent_bias", "special", "flatten_from")


def _nan_code(fmt: MinifloatFormat) -> int | None:
    """The (positive) NaN pattern, or None if the format has no NaN."""
    top, m = 2**fmt.exponent_width - 1, fmt.mantissa_width
    if fmt.special == "fn" or (fmt.special == "ieee" and m > 0):
        return (top << m) | (2**m - 1)
    return None


@functools.lru_cache(maxsize=64)
def _tables(fmt: MinifloatFormat) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For formats of at most 8 bits: every code's float32 value, and the inverse table from a value's top 16 bits
    (sign, exponent, 7 mantissa bits) to its code (-1 off the grid); None when some value needs more bits of
    float32 than its top 16 (the elementwise conversions then run). Both come from the elementwise functions."""
    if fmt.width > 8:
        return None
    codes = torch.arange(2**fmt.width, dtype=torch.int64)
    values = _values_elementwise(codes, fmt)
    bits = values.view(torch.int32)
    real = ~torch.isnan(values)
    if bool((bits[real] & 0xFFFF).any()):
        return None
    inverse = torch.full((1 << 16,), -1, dtype=torch.int64)
    inverse[(bits[real] >> 16) & 0xFFFF] = codes[real]
    return values, inverse


def minifloat_codes(v: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """The int64 bit patterns of float32 values on ``fmt``'s grid; NotPackable for a NaN / inf it cannot hold.

    Formats of at most 8 bits look the codes up by the values' top 16 bits (:func:`_tables`); a value off the
    grid gets some code, which is why every pack is checked by unpacking."""
    m = fmt.mantissa_width
    nan, inf = torch.isnan(v), torch.isinf(v)
    nan_code = _nan_code(fmt)
    has_nan = bool(nan.any())
    if has_nan and nan_code is None:
        raise NotPackable(f"minifloat E{fmt.exponent_width}M{m} ({fmt.special!r}) has no NaN code")
    if inf.any() and fmt.special != "ieee":
        raise NotPackable(f"minifloat E{fmt.exponent_width}M{m} ({fmt.special!r}) has no infinity")
    tables = _tables(fmt)
    if tables is None:
        return _codes_elementwise(v, fmt, nan, inf, nan_code)
    code = tables[1][(v.float().view(torch.int32) >> 16) & 0xFFFF]
    if has_nan:  # NaN keeps its sign, as the elementwise conversion does
        assert nan_code is not None
        code = torch.where(nan, nan_code | (torch.signbit(v).to(torch.int64) << (fmt.width - 1)), code)
    return code


def _codes_elementwise(v: torch.Tensor, fmt: MinifloatFormat, nan: torch.Tensor, inf: torch.Tensor,
                       nan_code: int | None) -> torch.Tensor:
    """:func:`minifloat_codes` by frexp and shifts in float64 / int64 (any width)."""
    m, top = fmt.mantissa_width, 2**fmt.exponent_width - 1
    sign = torch.signbit(v).to(torch.int64)
    a = torch.where(nan | inf, torch.zeros_like(v), v.abs()).to(torch.float64)
    _, e = torch.frexp(a)
    exp = (e - 1).to(torch.int64)
    normal = (a > 0) & (exp >= fmt.min_exponent)
    shift = torch.where(normal, m - exp, m - fmt.min_exponent)
    mant = (a * _pow2(shift, torch.float64)).to(torch.int64) - torch.where(normal, 2**m, 0)
    biased = torch.where(normal, exp + fmt.bias, 0)
    code = (biased << m) | mant
    if nan_code is not None:
        code = torch.where(nan, nan_code, code)
    code = torch.where(inf, top << m, code)
    return code | (sign << (fmt.width - 1))


def minifloat_values(code: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """The float32 values of int64 bit patterns of ``fmt`` (exact: every value of the format is a float32); bits
    above the format's width are ignored. Formats of at most 8 bits index the table of all their values."""
    tables = _tables(fmt)
    if tables is None:
        return _values_elementwise(code, fmt)
    return tables[0][code.to(torch.int64) & (2**fmt.width - 1)]


def _values_elementwise(code: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """:func:`minifloat_values` by shifts and float64 arithmetic (any width)."""
    m, top = fmt.mantissa_width, 2**fmt.exponent_width - 1
    sign = (code >> (fmt.width - 1)) & 1
    biased = (code >> m) & top
    mant = code & (2**m - 1)
    normal = biased > 0
    significand = (mant + torch.where(normal, 2**m, 0)).to(torch.float64)
    exp = torch.where(normal, biased - fmt.bias, fmt.min_exponent) - m
    a = significand * _pow2(exp, torch.float64)
    if fmt.special == "ieee":
        a = torch.where(biased == top, torch.where(mant == 0, float("inf"), float("nan")), a)
    elif fmt.special == "fn":
        a = torch.where((biased == top) & (mant == 2**m - 1), float("nan"), a)
    a = a.to(torch.float32)
    return torch.where(sign.bool(), -a, a)


def element_format(params: Mapping[str, Any], where: str) -> MinifloatFormat:
    """The minifloat a codec's ``width`` / ``exponent_width`` / ``exponent_bias`` / ``special`` name."""
    width = int_param(params, "width", 3, 32, where)
    ew = int_param(params, "exponent_width", 1, 8, where)
    bias = params["exponent_bias"]
    if bias is not None:
        bias = int_param(params, "exponent_bias", -256, 256, where)
    if params["special"] not in SPECIALS:
        raise ValueError(f"{where}: special must be one of {list(SPECIALS)}, got {params['special']!r}")
    try:
        return MinifloatFormat(ew, width - 1 - ew, bias, params["special"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parts(params: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, PartSpec]:
    """One part, ``codes``: the bit patterns in a stream of ``width`` bits each."""
    where = f"packed codec {NAME!r}"
    check_keys(params, KEYS, where)
    fmt = element_format(params, where)
    n = shape_numel(view_shape(tuple(shape), flatten_param(params, tuple(shape), where)), where)
    return {"codes": (torch.uint8, (stream_bytes(n, fmt.width),))}


def unpack(packed: PackedTensor) -> torch.Tensor:
    """The float32 weight, bit for bit the quantizer's values (signed zeros, inf and NaN included)."""
    want = parts(packed.params, tuple(packed.shape))
    got = {k: (t.dtype, tuple(t.shape)) for k, t in packed.parts.items()}
    if got != want:
        raise ValueError(f"packed codec {NAME!r}: parts {got} do not match the expected {want}")
    fmt = element_format(packed.params, NAME)
    n = shape_numel(tuple(packed.shape), NAME)
    return minifloat_values(unpack_bits(packed.parts["codes"], n, fmt.width), fmt).reshape(packed.shape)


def pack_minifloat(q: Quantize, x: torch.Tensor, ref: torch.Tensor, channel_axis: int, block_axis: int,
                   shape: tuple[int, ...], flatten_from: int | None) -> PackedTensor:
    """Bit patterns of ``ref = q(x)`` for a minifloat quantizer (elementwise: the axes do not matter)."""
    p = q.params
    fmt = MinifloatFormat(p["exponent_width"], p["width"] - 1 - p["exponent_width"], p["exponent_bias"],
                          p["special"])
    codes = minifloat_codes(ref.float(), fmt)
    params = {"width": fmt.width, "exponent_width": fmt.exponent_width, "exponent_bias": p["exponent_bias"],
              "special": fmt.special, "flatten_from": flatten_from}
    return PackedTensor(NAME, params, shape, {"codes": pack_bits(codes, fmt.width)})


MINIFLOAT_CODEC = Codec(NAME, parts, unpack)
