"""Block codecs: "block" (block_fp, mxint) and "mxfp" -- element codes plus one shared exponent per block.

Blocks run along the quantizer's block axis (``axis`` of the view it sees) exactly as block.py cuts them:
that axis moved last, a ragged last block zero-padded. Element codes are stored in that moved order without
the padding, ``width`` bits each; shared exponents one per block, row-major over (rows, blocks):

* ``block`` -- two's complement elements with ``width - 2`` fraction bits; the exponent biased by
  ``exponent_bias`` in ``exponent_width`` bits (mxint: E8M0, one uint8 per block). Integer codes have no
  negative zero (``-0.0`` reads back as ``+0.0``) and no NaN (not packable).
* ``mxfp``  -- minifloat element bit patterns (packing_float) and an E8M0 scale (``e + 127``, uint8).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...graph.packed import Codec, PackedTensor, PartSpec
from .block import _blocked, _floor_log2_amax, mxfp_element
from .fixed import integer_range
from .minifloat import pow2
from .packing_bits import (
    NotPackable,
    all_finite,
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
from .packing_float import minifloat_codes, minifloat_values
from .quantizer import Quantize

__all__ = ["BLOCK_CODEC", "MXFP_CODEC", "pack_block", "pack_mxfp"]

BLOCK_KEYS: tuple[str, ...] = ("width", "exponent_width", "exponent_bias", "block_size", "axis", "flatten_from")
MXFP_KEYS: tuple[str, ...] = ("width", "exponent_width", "block_size", "axis", "flatten_from")


def _geometry(params: Mapping[str, Any], shape: tuple[int, ...], where: str) -> tuple[tuple[int, ...], int, int,
                                                                                          int, int]:
    """(view, axis, elements along the axis, rows, blocks per row) of a blocked tensor."""
    view = view_shape(shape, flatten_param(params, shape, where))
    shape_numel(shape, where)
    axis = int_param(params, "axis", 0, len(view) - 1, where)
    bs = int_param(params, "block_size", 1, 4096, where)
    n = view[axis]
    rows = shape_numel(view[:axis] + view[axis + 1:], where)
    return view, axis, n, rows, -(-n // bs)


def _exponent_range(width: int, bias: int) -> tuple[int, int]:
    return max(-bias, -126), min(2**width - 1 - bias, 127)


def _block_params(params: Mapping[str, Any], where: str) -> tuple[int, int, int]:
    width = int_param(params, "width", 2, 24, where)
    ew = int_param(params, "exponent_width", 1, 8, where)
    bias = int_param(params, "exponent_bias", -256, 256, where)
    lo, hi = _exponent_range(ew, bias)
    if lo > hi:
        raise ValueError(f"{where}: exponent_width {ew} with bias {bias} holds no float32 exponent")
    return width, ew, bias


def _check(params: Mapping[str, Any], shape: tuple[int, ...], name: str, keys: tuple[str, ...]) -> str:
    where = f"packed codec {name!r}"
    check_keys(params, keys, where)
    return where


def block_parts(params: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, PartSpec]:
    """``codes`` (width-bit elements; int8 at width 8) and ``exponents`` (exponent_width bits per block)."""
    where = _check(params, shape, "block", BLOCK_KEYS)
    width, ew, _ = _block_params(params, where)
    _, _, n, rows, blocks = _geometry(params, tuple(shape), where)
    return {"codes": (torch.int8 if width == 8 else torch.uint8, (stream_bytes(rows * n, width),)),
            "exponents": (torch.uint8, (stream_bytes(rows * blocks, ew),))}


def mxfp_parts(params: Mapping[str, Any], shape: tuple[int, ...]) -> dict[str, PartSpec]:
    """``codes`` (element bit patterns) and ``scales`` (one E8M0 byte per block)."""
    where = _check(params, shape, "mxfp", MXFP_KEYS)
    width = int_param(params, "width", 4, 8, where)
    try:
        mxfp_element(width, int_param(params, "exponent_width", 2, 5, where))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    _, _, n, rows, blocks = _geometry(params, tuple(shape), where)
    return {"codes": (torch.uint8, (stream_bytes(rows * n, width),)), "scales": (torch.uint8, (rows * blocks,))}


def _checked_parts(packed: PackedTensor, want: dict[str, PartSpec]) -> None:
    got = {k: (t.dtype, tuple(t.shape)) for k, t in packed.parts.items()}
    if got != want:
        raise ValueError(f"packed codec {packed.codec!r}: parts {got} do not match the expected {want}")


def _unblock(elements: torch.Tensor, scale: torch.Tensor, view: tuple[int, ...], axis: int, n: int,
             bs: int) -> torch.Tensor:
    """``elements`` (rows * n, moved order) times their block's ``scale`` (rows * blocks), back in ``view``."""
    moved = (*view[:axis], *view[axis + 1:], n)
    e = elements.reshape(moved)
    pad = (-n) % bs
    if pad:
        e = F.pad(e, (0, pad))
    blocks = e.reshape(*moved[:-1], -1, bs)
    q = blocks * scale.reshape(*blocks.shape[:-1], 1)
    return q.reshape(*moved[:-1], -1)[..., :n].movedim(-1, axis)


def block_unpack(packed: PackedTensor) -> torch.Tensor:
    """``code * 2^(e - (width - 2))`` per block, as block_fp_quantize computes it."""
    _checked_parts(packed, block_parts(packed.params, tuple(packed.shape)))
    where = "packed codec 'block'"
    width, ew, bias = _block_params(packed.params, where)
    view, axis, n, rows, blocks = _geometry(packed.params, tuple(packed.shape), where)
    lo, hi = _exponent_range(ew, bias)
    e = unpack_bits(packed.parts["exponents"], rows * blocks, ew) - bias
    if e.numel() and (e.min() < lo or e.max() > hi):  # the packer clamps them into [lo, hi]
        raise ValueError(f"{where}: shared exponents must be in [{lo}, {hi}] (biased by {bias})")
    step = pow2(e, torch.float32) / 2.0 ** (width - 2)
    codes = unpack_signed(packed.parts["codes"], rows * n, width).to(torch.float32)
    out = _unblock(codes, step, view, axis, n, packed.params["block_size"])
    if not all_finite(out):
        raise ValueError(f"{where}: codes times shared exponents overflow float32 (integer codes hold no inf)")
    return out.reshape(packed.shape)


def mxfp_unpack(packed: PackedTensor) -> torch.Tensor:
    """Minifloat elements times their block's E8M0 scale, as mxfp_quantize computes them."""
    _checked_parts(packed, mxfp_parts(packed.params, tuple(packed.shape)))
    p = packed.params
    elem = mxfp_element(p["width"], p["exponent_width"])
    view, axis, n, rows, blocks = _geometry(p, tuple(packed.shape), "packed codec 'mxfp'")
    e = packed.parts["scales"].to(torch.int64) - 127
    if e.numel() and (e.min() < -126 or e.max() > 127):  # E8M0 255 is NaN; the packer writes 1..254
        raise ValueError("packed codec 'mxfp': E8M0 scales must be in [1, 254] (2^-126 .. 2^127)")
    values = minifloat_values(unpack_bits(packed.parts["codes"], rows * n, elem.width), elem)
    out = _unblock(values, pow2(e, torch.float32), view, axis, n, p["block_size"])
    if not bool((torch.isfinite(out) | ~torch.isfinite(_unblock(values, torch.ones_like(e, dtype=torch.float32),
                                                                 view, axis, n, p["block_size"]))).all()):
        raise ValueError("packed codec 'mxfp': finite elements times their scale overflow float32")
    return out.reshape(packed.shape)


def _moved_codes(values: torch.Tensor, moved_shape: tuple[int, ...], n: int) -> torch.Tensor:
    """Padded (..., blocks, block_size) values -> the unpadded moved order, flat."""
    return values.reshape(moved_shape)[..., :n].reshape(-1)


def pack_block(q: Quantize, x: torch.Tensor, ref: torch.Tensor, channel_axis: int, block_axis: int,
               shape: tuple[int, ...], flatten_from: int | None) -> PackedTensor:
    """Element codes and biased shared exponents of ``q(x)`` for a block_fp / mxint quantizer."""
    p = q.params
    width, bs = int(p["width"]), int(p["block_size"])
    ew, bias = (8, 127) if q.fmt.name == "mxint" else (int(p["exponent_width"]), p["exponent_bias"])
    bias = 2 ** (ew - 1) - 1 if bias is None else int(bias)
    if torch.isnan(x).any():
        raise NotPackable(f"{q.fmt.name} weight holds NaN, which integer element codes cannot represent")
    qmin, qmax = integer_range(width)
    blocks, moved_shape, n = _blocked(x.float(), bs, block_axis)
    lo, hi = _exponent_range(ew, bias)
    e = torch.clamp(_floor_log2_amax(blocks), lo, hi)
    step = pow2(e, torch.float32) / 2.0 ** (width - 2)
    codes = torch.clamp(torch.round(blocks / step), qmin, qmax).to(torch.int8 if width <= 8 else torch.int64)
    params = {"width": width, "exponent_width": ew, "exponent_bias": bias, "block_size": bs, "axis": block_axis,
              "flatten_from": flatten_from}
    stream = pack_bits(_moved_codes(codes, moved_shape, n), width)
    parts = {"codes": stream.view(torch.int8) if width == 8 else stream,
             "exponents": pack_bits((e + bias).reshape(-1), ew)}
    return PackedTensor("block", params, shape, parts)


def pack_mxfp(q: Quantize, x: torch.Tensor, ref: torch.Tensor, channel_axis: int, block_axis: int,
              shape: tuple[int, ...], flatten_from: int | None) -> PackedTensor:
    """Element bit patterns and E8M0 scales of ``q(x)`` for an mxfp quantizer."""
    from .minifloat import minifloat_quantize

    p = q.params
    width, bs = int(p["width"]), int(p["block_size"])
    elem = mxfp_element(width, int(p["exponent_width"]))
    blocks, moved_shape, n = _blocked(x.float(), bs, block_axis)
    e = torch.clamp(_floor_log2_amax(blocks) - elem.max_exponent, -126, 127)
    elements = minifloat_quantize(blocks / pow2(e, torch.float32), elem)
    params = {"width": width, "exponent_width": int(p["exponent_width"]), "block_size": bs, "axis": block_axis,
              "flatten_from": flatten_from}
    parts = {"codes": pack_bits(minifloat_codes(_moved_codes(elements, moved_shape, n), elem), width),
             "scales": (e + 127).reshape(-1).to(torch.uint8)}
    return PackedTensor("mxfp", params, shape, parts)


BLOCK_CODEC = Codec("block", block_parts, block_unpack)
MXFP_CODEC = Codec("mxfp", mxfp_parts, mxfp_unpack)
