"""Packed weights: every format's codec stores a quantizer's output at its width and reads it back bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fxforge.graph.packed import PackedTensor, codec, codec_names
from fxforge.passes.quantize.formats import get_format
from fxforge.passes.quantize.packing import NotPackable, pack_weight, packed_bits, unpack
from fxforge.passes.quantize.packing_bits import pack_bits, stream_bytes, unpack_bits
from fxforge.passes.quantize.quantizer import Quantize


def _weight(rows: int = 48, cols: int = 70, seed: int = 0) -> torch.Tensor:
    """A weight with outliers, exact zeros of both signs, ties and tiny values (rows of different ranges)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows).unsqueeze(1)
    w[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    w[1, :3] = torch.tensor([0.5, 1.5, -2.5])
    w[2, 5] = 1e4  # saturates every narrow format of its row
    return w


def _quantizer(spec: dict[str, Any], channel_axis: int = 0, block_axis: int = -1) -> Quantize:
    return Quantize(spec, "weight", is_param=True, channel_axis=channel_axis, block_axis=block_axis)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def assert_round_trip(spec: dict[str, Any], w: torch.Tensor, **kw: Any) -> PackedTensor:
    """Pack ``w``, check the parts against ``parts()``, and unpack to exactly ``q(w)``."""
    q = _quantizer(spec, **kw)
    p = pack_weight(q, w)
    assert p.shape == tuple(w.shape)
    c = codec(p.codec)
    assert {k: (t.dtype, tuple(t.shape)) for k, t in p.parts.items()} == c.parts(p.params, p.shape)
    out, ref = c.unpack(p), q(w)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    return p


# -- bit streams -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 23, 24, 31, 32])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 101])
def test_bit_stream_round_trip(width: int, n: int) -> None:
    codes = torch.randint(0, 2**width, (n,), generator=torch.Generator().manual_seed(width * 1000 + n))
    stream = pack_bits(codes, width)
    assert stream.dtype == torch.uint8 and stream.numel() == stream_bytes(n, width) == -(-n * width // 8)
    assert torch.equal(unpack_bits(stream, n, width), codes)


def test_bit_stream_layout_is_little_endian() -> None:
    assert pack_bits(torch.tensor([1, 2, 3]), 4).tolist() == [0x21, 0x03]  # first code in the low nibble
    assert pack_bits(torch.tensor([0x1234, 0xABCD]), 16).tolist() == [0x34, 0x12, 0xCD, 0xAB]
    assert pack_bits(torch.tensor([5, 2, 7]), 3).tolist() == [0b11010101, 0b1]  # 101 010 111 from bit 0
    assert pack_bits(torch.tensor([-1, -2]), 2).tolist() == [0b1011]  # two's complement, low 2 bits
    with pytest.raises(ValueError, match="stream of 5 3-bit codes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 5, 3)


# -- int codec: integer (fixed point) and scaled_integer ---------------------------------------------------
@pytest.mark.parametrize("width,frac", [(w, f) for w in (2, 3, 4, 5, 6, 7, 8, 12, 16, 25, 32)
                                         for f in (0, 2, -3, "auto")])
def test_integer_round_trips(width: int, frac: Any) -> None:
    w = _weight()
    p = assert_round_trip({"format": "integer", "width": width, "frac_width": frac}, w)
    assert p.codec == "int" and p.params["mode"] == ("pow2" if frac == "auto" else "fixed")
    signed8 = width == 8
    assert p.parts["codes"].dtype == (torch.int8 if signed8 else torch.uint8)
    assert p.parts["codes"].numel() == stream_bytes(w.numel(), width)
    if frac == "auto":  # one fraction width per output row, int8
        assert p.parts["frac"].dtype == torch.int8 and p.parts["frac"].shape == (w.shape[0],)


def test_integer_saturates_and_reads_zeros_back() -> None:
    x = torch.tensor([[1e12, -1e12, float("inf"), float("-inf"), 3.0, -0.2, -0.0, 0.0]])
    for width in (2, 4, 8, 24, 25, 32):  # above 24 bits float32 rounds 2^(w-1) - 1 up: still exact
        q = _quantizer({"format": "integer", "width": width, "frac_width": 0})
        out = unpack(pack_weight(q, x))
        hi, lo = float(torch.tensor(2.0 ** (width - 1) - 1)), -(2.0 ** (width - 1))
        assert out[0, :4].tolist() == [hi, lo, hi, lo]
        assert torch.equal(out, q(x))
    # -0.2 -> -0.0 in the quantizer; integer codes carry no sign of zero, so +0.0 (equal in value)
    assert torch.signbit(q(x)[0, 5]) and not torch.signbit(out[0, 5])


@pytest.mark.parametrize("width", [2, 3, 4, 5, 8, 11, 16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel"])
def test_scaled_integer_round_trips(width: int, symmetric: bool, granularity: str) -> None:
    w = _weight()
    spec = {"format": "scaled_integer", "width": width, "symmetric": symmetric, "granularity": granularity}
    p = assert_round_trip(spec, w)
    per = (w.shape[0],) if granularity == "per_channel" else ()
    assert p.parts["scale"].dtype == torch.float32 and p.parts["scale"].shape == per
    assert ("zero_point" in p.parts) == (not symmetric)
    # bit for bit: scaled integers never produce -0.0 (round(x / s) + 0.0 is +0.0), so the signs match too
    q = _quantizer(spec)
    assert torch.equal(_bits(unpack(p)), _bits(q(w)))


def test_integer_axes_and_shapes() -> None:
    w = _weight(12, 40)
    assert_round_trip({"format": "integer", "width": 4, "frac_width": "auto"}, w, channel_axis=1)
    assert_round_trip({"format": "scaled_integer", "width": 4, "granularity": "per_channel"}, w, channel_axis=1)
    bias = torch.randn(33)  # 1-d: auto fixed point takes one fraction width for the tensor
    p = assert_round_trip({"format": "integer", "width": 6, "frac_width": "auto"}, bias)
    assert p.parts["frac"].shape == ()
    scalar = torch.tensor(0.7)
    assert_round_trip({"format": "scaled_integer", "width": 3}, scalar)
    assert_round_trip({"format": "integer", "width": 5, "frac_width": 3}, torch.randn(3, 4, 5))


def test_integer_nan_is_not_packable() -> None:
    w = _weight()
    w[3, 3] = float("nan")
    for spec in ({"format": "integer", "width": 8, "frac_width": 4}, {"format": "scaled_integer", "width": 8}):
        with pytest.raises(NotPackable, match="NaN"):
            pack_weight(_quantizer(spec), w)


def test_refuses_what_it_cannot_store_exactly() -> None:
    q = _quantizer({"format": "integer", "width": 4, "frac_width": 2})
    with pytest.raises(NotPackable, match="float32 only"):
        pack_weight(q, torch.randn(4, 4, dtype=torch.bfloat16))
    q.enabled = False
    with pytest.raises(NotPackable, match="disabled"):
        pack_weight(q, torch.randn(4, 4))
    assert issubclass(NotPackable, ValueError)


def test_int_parts_reject_bad_params() -> None:
    c = codec("int")
    good = pack_weight(_quantizer({"format": "scaled_integer", "width": 4, "granularity": "per_channel"}),
                       _weight(8, 16))
    assert c.parts(good.params, good.shape)["codes"] == (torch.uint8, (64,))
    bad: list[dict[str, Any]] = [
        {"width": 17}, {"width": 1}, {"width": True}, {"width": "4"}, {"mode": "log"}, {"axis": 2},
        {"axis": -1}, {"symmetric": None}, {"frac_width": 3}, {"flatten_from": 5},
    ]
    for change in bad:
        with pytest.raises(ValueError, match="packed codec 'int'"):
            c.parts({**good.params, **change}, good.shape)
    with pytest.raises(ValueError, match="exactly"):
        c.parts({**good.params, "extra": 1}, good.shape)
    with pytest.raises(ValueError, match="shape"):
        c.parts(good.params, (8, -16))
    fixed = {"width": 40, "mode": "fixed", "frac_width": 0, "axis": None, "symmetric": None, "flatten_from": None}
    with pytest.raises(ValueError, match="width"):
        c.parts(fixed, (4,))
    with pytest.raises(ValueError, match="frac_width"):
        c.parts({**fixed, "width": 8, "frac_width": 65}, (4,))
    # a part of the wrong size is refused when decoding
    short = PackedTensor(good.codec, good.params, good.shape, {**good.parts, "codes": good.parts["codes"][:-1]})
    with pytest.raises(ValueError, match="do not match"):
        c.unpack(short)


def test_codecs_are_registered() -> None:
    assert "int" in codec_names()


def test_packed_bytes_match_the_accounted_bits() -> None:
    w = torch.randn(384, 1536)
    specs = [{"format": "integer", "width": b, "frac_width": f} for b in (2, 3, 4, 8) for f in (1, "auto")]
    specs += [{"format": "scaled_integer", "width": b, "symmetric": s, "granularity": g}
              for b in (2, 4, 8) for s in (True, False) for g in ("per_tensor", "per_channel")]
    for spec in specs:
        q = _quantizer(spec)
        p = pack_weight(q, w)
        accounted = get_format(spec["format"]).bits(q.params) * w.numel() / 8
        assert accounted <= p.nbytes <= 1.05 * accounted, spec
        assert packed_bits(p) == 8 * p.nbytes
