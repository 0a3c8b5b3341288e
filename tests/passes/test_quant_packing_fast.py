"""The fast packing paths are exact: vectorised bit streams equal a bit-by-bit reference at every width, and
``pack_weight`` still checks every record against the quantizer's values (running the quantizer once)."""

from __future__ import annotations

import pytest
import torch

from fxforge.passes.quantize import packing_float, packing_int
from fxforge.passes.quantize.fixed import fixed_point_quantize, scaled_integer_quantize
from fxforge.passes.quantize.minifloat import SPECIALS, MinifloatFormat
from fxforge.passes.quantize.packing import NotPackable, pack_weight, unpack
from fxforge.passes.quantize.packing_bits import (
    all_finite,
    pack_bits,
    stream_bytes,
    to_signed,
    unpack_bits,
    unpack_signed,
)
from fxforge.passes.quantize.packing_float import minifloat_codes, minifloat_values
from fxforge.passes.quantize.quantizer import Quantize


def reference_stream(codes: list[int], width: int) -> list[int]:
    """Little-endian stream built one bit at a time (code i's bit b is stream bit i * width + b)."""
    out = [0] * stream_bytes(len(codes), width)
    for i, c in enumerate(codes):
        for b in range(width):
            if (c >> b) & 1:
                j = i * width + b
                out[j // 8] |= 1 << (j % 8)
    return out


@pytest.mark.parametrize("width", list(range(1, 33)))
def test_bit_streams_equal_a_bitwise_reference_at_every_width(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    lo, hi = -(2 ** (width - 1)), 2 ** (width - 1)
    for n in (1, 3, 8, 13, 64, 203):
        signed = torch.randint(lo, hi, (n,), generator=gen)
        signed[0] = lo  # the extremes of the two's complement range
        signed[-1] = hi - 1
        unsigned = signed & ((1 << width) - 1)
        want = reference_stream(unsigned.tolist(), width)
        for codes in (signed, unsigned, signed.to(torch.int32) if width <= 31 else signed):
            stream = pack_bits(codes, width)
            assert stream.dtype == torch.uint8 and stream.tolist() == want
        stream = pack_bits(signed, width)
        assert torch.equal(unpack_bits(stream, n, width), unsigned)
        assert torch.equal(unpack_signed(stream, n, width).to(torch.int64), signed)
        assert torch.equal(unpack_signed(stream.view(torch.int8), n, width).to(torch.int64), signed)
        assert torch.equal(to_signed(unsigned, width), signed)


def test_to_signed_on_unsigned_dtypes() -> None:
    codes = torch.tensor([0, 7, 8, 15], dtype=torch.uint8)
    assert to_signed(codes.to(torch.int16), 4).tolist() == [0, 7, -8, -1]
    assert to_signed(codes.to(torch.int64), 4).tolist() == [0, 7, -8, -1]


def test_unpack_signed_refuses_a_stream_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="stream of 5 4-bit codes"):
        unpack_signed(torch.zeros(2, dtype=torch.uint8), 5, 4)


def _quantizer(spec: dict[str, object], **kw: object) -> Quantize:
    return Quantize(spec, role="weight", is_param=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [
    {"format": "integer", "width": 4, "frac_width": "auto"},
    {"format": "integer", "width": 4, "frac_width": 3},
    {"format": "integer", "width": 8, "frac_width": "auto"},
    {"format": "integer", "width": 7, "frac_width": -2},
    {"format": "scaled_integer", "width": 4, "granularity": "per_channel"},
])
def test_every_pack_is_checked_against_the_quantizer(spec: dict[str, object],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A packer that writes one wrong code is caught by pack_weight's check (the contract holds on every pack)."""
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * 3
    q = _quantizer(spec)
    assert torch.equal(unpack(pack_weight(q, w)), q(w))
    real = packing_int.pack_bits

    def corrupt(codes: torch.Tensor, width: int) -> torch.Tensor:
        codes = codes.clone()
        codes.view(-1)[17] ^= 1  # flip the low bit of one code
        return real(codes, width)

    monkeypatch.setattr(packing_int, "pack_bits", corrupt)
    with pytest.raises(NotPackable, match="do not reproduce the quantizer's values"):
        pack_weight(q, w)


def test_pack_weight_runs_the_quantizer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The codes are derived from the one quantized tensor the check compares against (no second quantizer run)."""
    calls = []
    real = Quantize._quantize

    def counted(self: Quantize, *args: object) -> torch.Tensor:
        calls.append(1)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Quantize, "_quantize", counted)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for spec in ({"format": "integer", "width": 4, "frac_width": "auto"},
                 {"format": "minifloat", "width": 8, "exponent_width": 4, "special": "fn"}):
        calls.clear()
        q = _quantizer(spec)
        pack_weight(q, w)
        assert len(calls) == 1, spec


def test_all_finite_finds_nan_and_both_infinities() -> None:
    x = torch.randn(64, 33)
    assert all_finite(x) and all_finite(torch.zeros(0, 3))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[40, 7] = bad
        assert not all_finite(y) and not all_finite(torch.tensor(bad))


@pytest.mark.parametrize("quantize,lo,hi", [
    (lambda x: fixed_point_quantize(x, 4, 2), -2.0, 1.75),  # [-8, 7] / 4
    (lambda x: scaled_integer_quantize(x, torch.tensor(0.25), torch.tensor(0.0), 4, True), -1.75, 1.75),  # narrow
])
def test_inference_quantizers_skip_only_the_gradient_mask(quantize: object, lo: float, hi: float) -> None:
    """Without autograd the clip mask is not built; values equal the autograd path's bit for bit, and the
    autograd path still passes the gradient only inside the range."""
    x = torch.linspace(-4, 4, 101)
    with torch.no_grad():
        fast = quantize(x)  # type: ignore[operator]
    xg = x.clone().requires_grad_(True)
    slow = quantize(xg)  # type: ignore[operator]
    assert torch.equal(fast, slow.detach())
    slow.sum().backward()
    assert xg.grad is not None and 0 < int(xg.grad.sum()) < x.numel()
    assert torch.equal(xg.grad, ((x >= lo) & (x <= hi)).float())


def _minifloat_formats() -> list[MinifloatFormat]:
    out = []
    for width in range(3, 9):
        for ew in range(1, width):
            for special in SPECIALS:
                for bias in (None, -3, 20):
                    try:
                        out.append(MinifloatFormat(ew, width - 1 - ew, bias, special))
                    except ValueError:
                        continue
    return out


def test_minifloat_tables_equal_the_elementwise_conversions() -> None:
    """For every minifloat of at most 8 bits (all exponent widths, specials, three biases): each code's value from
    the table is bit for bit the elementwise one, and each value (NaN of both signs, +-0, +-inf) looks up the
    elementwise code. The table path is taken for most of them."""
    tabled = 0
    for fmt in _minifloat_formats():
        codes = torch.arange(2**fmt.width)
        want = packing_float._values_elementwise(codes, fmt)
        got = minifloat_values(codes, fmt)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), fmt
        assert torch.equal(minifloat_values(codes + (5 << fmt.width), fmt).view(torch.int32), want.view(torch.int32))
        nan, inf = torch.isnan(want), torch.isinf(want)
        nan_code = packing_float._nan_code(fmt)
        keep = ~nan | torch.tensor(nan_code is not None)
        v = want[keep]
        assert torch.equal(minifloat_codes(v, fmt),
                           packing_float._codes_elementwise(v, fmt, nan[keep], inf[keep], nan_code)), fmt
        tabled += packing_float._tables(fmt) is not None
    assert tabled > 100


def test_minifloat_off_grid_values_are_not_packable() -> None:
    """A value between two E4M3 values gets a code that does not reproduce it, which the pack check refuses."""
    q = _quantizer({"format": "minifloat", "width": 8, "exponent_width": 4, "special": "fn"})
    q.prequantized = True  # passes the float weight through: values off the grid
    with pytest.raises(NotPackable, match="do not reproduce"):
        pack_weight(q, torch.full((4, 4), 1.0 + 2.0**-10))
    assert torch.equal(unpack(pack_weight(q, torch.full((4, 4), 1.125))), torch.full((4, 4), 1.125))
