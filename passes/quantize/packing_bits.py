"""Little-endian bit streams: ``n`` codes of exactly ``width`` bits each, packed back to back into bytes.

Code ``i`` occupies stream bits ``[i * width, (i + 1) * width)``; stream bit ``j`` is bit ``j % 8`` of byte
``j // 8`` (so two int4 codes share a byte, the first in the low nibble, and 16-bit codes are little-endian
int16). Packing works on whole-byte groups of codes (``8 / gcd(width, 8)`` codes), a few tensor ops per group
position: 1/2/4/8-bit codes on uint8, other widths whose group fits 56 bits as one little-endian int64 word
per group, the rest (odd widths above 8, 18/22/26/30) byte by byte over groups of 8; no per-element Python and
no tensor of single bits. Also the checks a codec's ``parts()`` shares: JSON parameter types and ranges.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["NotPackable", "all_finite", "stream_bytes", "pack_bits", "unpack_bits", "to_signed", "unpack_signed",
           "int_param", "bool_param", "shape_numel", "view_shape", "flatten_param", "check_keys"]

MAX_WIDTH = 32  # widest code a stream holds (codes are carried in int64)


def stream_bytes(n: int, width: int) -> int:
    """Bytes of a stream of ``n`` codes of ``width`` bits (the last byte zero-padded)."""
    return (n * width + 7) // 8


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"bit-stream code width must be in [1, {MAX_WIDTH}], got {width}")


def _group(width: int) -> int:
    """Codes per whole-byte group: the fewest codes whose bits fill whole bytes (8 / gcd(width, 8))."""
    return 8 // math.gcd(width, 8)


def _word_path(width: int) -> bool:
    """Does a group fit one int64 word (at most 56 bits, so shifts never reach the sign), read little-endian?"""
    return _group(width) * width <= 56 and sys.byteorder == "little"


def _padded(c: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-c.numel()) % multiple
    return torch.cat([c, c.new_zeros(pad)]) if pad else c


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """``codes`` (any integer dtype, only their low ``width`` bits are kept) as a uint8 stream of
    :func:`stream_bytes` bytes."""
    _check_width(width)
    n = codes.numel()
    if width <= 8:  # low bits survive the cast to uint8 (integer casts wrap)
        c = codes.reshape(-1).to(torch.uint8)
        if width == 8:
            return c
        c = c & ((1 << width) - 1)
        if 8 % width == 0:  # 1, 2, 4 bits: 8 // width codes per byte, shifted into place on uint8
            g = 8 // width
            c = _padded(c, g).reshape(-1, g)
            out = c[:, 0].clone()
            for k in range(1, g):
                out |= c[:, k] << (k * width)
            return out
    if _word_path(width):  # a group's codes shifted into one int64 word, whose low bytes are the group's bytes
        g = _group(width)
        c = _padded(codes.reshape(-1).to(torch.int64) & ((1 << width) - 1), g).reshape(-1, g)
        word = torch.empty(c.shape[0], dtype=torch.int64).copy_(c[:, 0])  # fresh strides: viewed as bytes
        for k in range(1, g):
            word |= c[:, k] << (k * width)
        return word.view(torch.uint8).reshape(-1, 8)[:, : g * width // 8].reshape(-1)[: stream_bytes(n, width)]
    return _pack_groups_of_8(codes.reshape(-1).to(torch.int64) & ((1 << width) - 1), width)


def _pack_groups_of_8(c: torch.Tensor, width: int) -> torch.Tensor:
    """Any width: groups of 8 codes (exactly ``width`` bytes), built byte by byte."""
    n = c.numel()
    c = _padded(c, 8).reshape(-1, 8)
    out = torch.zeros(c.shape[0], width, dtype=torch.int64)
    for b in range(width):  # byte b of a group holds group bits [8b, 8b + 8)
        for k in range((8 * b) // width, min(8, (8 * b + 7) // width + 1)):
            shift = k * width - 8 * b
            out[:, b] |= (c[:, k] << shift) if shift >= 0 else (c[:, k] >> -shift)
    return (out & 0xFF).to(torch.uint8).reshape(-1)[: stream_bytes(n, width)]


def _stream(stream: torch.Tensor, n: int, width: int) -> torch.Tensor:
    _check_width(width)
    raw = stream.reshape(-1)
    if raw.dtype not in (torch.uint8, torch.int8) or raw.numel() != stream_bytes(n, width):
        raise ValueError(f"a stream of {n} {width}-bit codes is {stream_bytes(n, width)} uint8/int8 bytes, got "
                         f"{raw.numel()} of {raw.dtype}")
    return raw.view(torch.uint8)


def unpack_bits(stream: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """The ``n`` unsigned ``width``-bit codes of a stream (int64); ValueError if the stream's size is not
    :func:`stream_bytes`."""
    b = _stream(stream, n, width)
    if width <= 8 and 8 % width == 0:
        return _unpack_small(b, n, width).to(torch.int64)
    if _word_path(width):
        g = _group(width)
        nb = g * width // 8
        words = torch.zeros(-(-n // g), 8, dtype=torch.uint8)
        words[:, :nb] = _padded(b, nb).reshape(-1, nb)
        w = words.view(torch.int64)  # (groups, 1)
        shifts = torch.arange(0, g * width, width, dtype=torch.int64)
        return ((w >> shifts) & ((1 << width) - 1)).reshape(-1)[:n]
    return _unpack_groups_of_8(b, n, width)


def _unpack_small(b: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """1, 2, 4 or 8-bit codes as uint8 (``8 // width`` codes per byte, the first in the low bits)."""
    if width == 8:
        return b
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return ((b.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:n]


def _unpack_groups_of_8(b: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """Any width: code k of a group of 8 gathered from the bytes holding its bits."""
    groups = (n + 7) // 8
    b = _padded(b.to(torch.int64), groups * width).reshape(groups, width)
    out = torch.zeros(groups, 8, dtype=torch.int64)
    for k in range(8):  # code k of a group holds group bits [k * width, (k + 1) * width)
        for byte in range((k * width) // 8, (k * width + width - 1) // 8 + 1):
            shift = 8 * byte - k * width
            out[:, k] |= (b[:, byte] << shift) if shift >= 0 else (b[:, byte] >> -shift)
    return (out & ((1 << width) - 1)).reshape(-1)[:n]


def unpack_signed(stream: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """The ``n`` two's complement ``width``-bit codes of a stream: int8 for widths 1, 2, 4, 8 (sign-extended by
    an arithmetic shift, no int64 round trip), int64 otherwise."""
    b = _stream(stream, n, width)
    if width <= 8 and 8 % width == 0:
        return (_unpack_small(b, n, width) << (8 - width)).view(torch.int8) >> (8 - width)
    return to_signed(unpack_bits(stream, n, width), width)


def to_signed(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned ``width``-bit codes read as two's complement (signed dtypes: two shifts, the right one
    arithmetic)."""
    if codes.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        spare = 8 * codes.element_size() - width
        return (codes << spare) >> spare if spare > 0 else codes
    return codes - ((codes >> (width - 1)) & 1) * (1 << width)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in ``t`` (its min and max propagate both: two fast reductions, no boolean tensor)."""
    return t.numel() == 0 or bool(torch.isfinite(t.amin()) & torch.isfinite(t.amax()))


def int_param(params: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    """``params[key]`` as an int in ``[lo, hi]`` (bool refused); ValueError naming the codec otherwise."""
    v = params.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{where}: parameter {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def bool_param(params: Mapping[str, Any], key: str, where: str) -> bool:
    v = params.get(key)
    if not isinstance(v, bool):
        raise ValueError(f"{where}: parameter {key!r} must be a bool, got {v!r}")
    return v


def shape_numel(shape: Any, where: str) -> int:
    """Elements of a logical shape (a tuple/list of non-negative ints, at most 8 dims); ValueError otherwise."""
    if not isinstance(shape, (tuple, list)) or len(shape) > 8 or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
        raise ValueError(f"{where}: shape must be at most 8 non-negative ints, got {shape!r}")
    n = 1
    for d in shape:
        n *= d
    if n >= 2**40:
        raise ValueError(f"{where}: shape {tuple(shape)} holds {n} elements, more than a packed tensor may")
    return n


class NotPackable(ValueError):
    """A quantizer's output cannot be stored exactly at its format's width (the message says why)."""


def view_shape(shape: tuple[int, ...], flatten_from: int | None) -> tuple[int, ...]:
    """The shape a layer's quantizer sees: ``shape`` flattened from ``flatten_from`` on (a conv kernel is
    quantized as (out, in * kernel)), a 0-d tensor as one element (as :class:`Quantize` does)."""
    if flatten_from is not None:
        n = 1
        for d in shape[flatten_from:]:
            n *= d
        shape = (*shape[:flatten_from], n)
    return shape if shape else (1,)


def flatten_param(params: Mapping[str, Any], shape: tuple[int, ...], where: str) -> int | None:
    """The ``flatten_from`` parameter: None, or an axis of ``shape`` (ValueError otherwise)."""
    f = params.get("flatten_from")
    if f is None:
        return None
    return int_param(params, "flatten_from", 0, max(len(shape) - 1, 0), where)


def check_keys(params: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """Refuse parameters a codec does not know (and missing ones): a file names exactly the codec's keys."""
    if not isinstance(params, Mapping) or set(params) != set(allowed):
        got = sorted(params) if isinstance(params, Mapping) else params
        raise ValueError(f"{where}: parameters must be exactly {sorted(allowed)}, got {got!r}")
