"""Packed weights: every format's codec stores a quantizer's output at its width and reads it back bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, logits

from fxforge import ForgeGraph
from fxforge.graph.packed import PackedTensor, codec, codec_names
from fxforge.passes.quantize import quantize_transform_pass
from fxforge.passes.quantize.formats import get_format
from fxforge.passes.quantize.modules import QuantizedConv2d, QuantizedEmbedding, QuantizedLinear
from fxforge.passes.quantize.packing import NotPackable, pack_layer_weight, pack_weight, packed_bits, unpack
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
    w[3, 3] = float("inf")  # an infinite scale: the scaled integer quantizer returns NaN for the tensor
    q = _quantizer({"format": "scaled_integer", "width": 8})
    assert torch.isnan(q(w)).all()
    with pytest.raises(NotPackable, match="infinite"):
        pack_weight(q, w)
    q = _quantizer({"format": "integer", "width": 8, "frac_width": "auto"})  # auto fixed point saturates it
    assert torch.equal(unpack(pack_weight(q, w)), q(w))


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
    assert {"int", "minifloat", "block", "mxfp"} <= set(codec_names())


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


# -- minifloat ---------------------------------------------------------------------------------------------
MINIFLOATS = [(8, 4, "fn"), (8, 5, "ieee"), (8, 4, "ieee"), (6, 2, "none"), (6, 3, "none"), (4, 2, "none"),
              (3, 1, "none"), (5, 2, "ieee"), (7, 3, "fn"), (12, 5, "ieee"), (16, 5, "ieee"), (16, 7, "fn"),
              (32, 8, "ieee")]


def _specials() -> torch.Tensor:
    """Weights with +-inf, NaN of both signs, signed zeros, subnormal-range and out-of-range values."""
    w = _weight(16, 40)
    w[3, :8] = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), -0.0, 0.0, 1e30, -1e30])
    w[4, :3] = torch.tensor([1e-40, -1e-40, -1e-7])
    return w


@pytest.mark.parametrize("width,ew,special", MINIFLOATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_minifloat_round_trips_bit_for_bit(width: int, ew: int, special: str, saturate: bool) -> None:
    spec = {"format": "minifloat", "width": width, "exponent_width": ew, "special": special, "saturate": saturate}
    q = _quantizer(spec)
    w = _specials() if special != "none" else torch.nan_to_num(_specials(), nan=1.0)
    ref = q(w)
    if special == "fn" and not saturate:  # overflow and inf become NaN; their signs are kept
        assert torch.isnan(ref[3, :2]).all() and torch.signbit(ref[3, 1])
    p = pack_weight(q, w)
    assert p.codec == "minifloat" and p.parts["codes"].numel() == stream_bytes(w.numel(), width)
    out = unpack(p)
    assert torch.equal(_bits(out), _bits(ref))  # -0.0, inf and NaN (with sign) included
    assert torch.signbit(out[3, 4]) and not torch.signbit(out[3, 5])
    if special != "none":
        assert torch.isnan(out[3, 2:4]).all() and torch.signbit(out[3, 3]) and not torch.signbit(out[3, 2])


def test_minifloat_e4m3_codes_are_torch_float8_bytes() -> None:
    w = _weight(16, 40)
    q = _quantizer({"format": "minifloat", "width": 8, "exponent_width": 4, "special": "fn"})
    p = pack_weight(q, w)
    assert torch.equal(p.parts["codes"], w.to(torch.float8_e4m3fn).reshape(-1).view(torch.uint8))


def test_minifloat_without_nan_code_is_not_packable() -> None:
    w = _weight()
    w[0, 7] = float("nan")
    with pytest.raises(NotPackable, match="no NaN code"):
        pack_weight(_quantizer({"format": "minifloat", "width": 4, "exponent_width": 2, "special": "none"}), w)
    with pytest.raises(NotPackable, match="no NaN code"):  # E5M0 'ieee': the top exponent is inf only
        pack_weight(_quantizer({"format": "minifloat", "width": 6, "exponent_width": 5}), w)


# -- block formats: block_fp, mxint, mxfp --------------------------------------------------------------------
@pytest.mark.parametrize("width", [2, 3, 4, 5, 6, 7, 8, 12, 24])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_mxint_and_block_fp_round_trip(width: int, block_size: int) -> None:
    w = _weight(48, 70)  # 70 = 2 * 32 + 6: a partial last block at every block size but 1 and 7
    for spec in ({"format": "mxint", "width": width, "block_size": block_size},
                 {"format": "block_fp", "width": width, "exponent_width": 4, "block_size": block_size},
                 {"format": "block_fp", "width": width, "exponent_width": 3, "exponent_bias": 1,
                  "block_size": block_size}):
        p = assert_round_trip(spec, w)
        blocks = 48 * -(-70 // block_size)
        ew = 8 if spec["format"] == "mxint" else spec["exponent_width"]
        assert p.codec == "block" and p.parts["exponents"].numel() == stream_bytes(blocks, ew)
        assert p.parts["codes"].dtype == (torch.int8 if width == 8 else torch.uint8)


def test_block_formats_along_other_axes_and_with_infinities() -> None:
    w = _weight(37, 20)
    w[5, 5], w[6, 6] = float("inf"), float("-inf")
    for spec in ({"format": "mxint", "width": 4, "block_size": 16},
                 {"format": "block_fp", "width": 6, "exponent_width": 5, "block_size": 8},
                 {"format": "mxfp", "width": 8, "exponent_width": 5, "block_size": 16},
                 {"format": "mxfp", "width": 4, "exponent_width": 2, "block_size": 32}):
        assert_round_trip(spec, w, block_axis=0)  # blocks down the columns: 37 = 2 * 16 + 5
        assert_round_trip(spec, torch.randn(3, 5, 11), block_axis=1)


@pytest.mark.parametrize("width,ew", [(8, 4), (8, 5), (6, 2), (6, 3), (4, 2)])
@pytest.mark.parametrize("block_size", [1, 7, 32])
def test_mxfp_round_trips_bit_for_bit(width: int, ew: int, block_size: int) -> None:
    w = _specials() if (width, ew) in ((8, 4), (8, 5)) else torch.nan_to_num(_specials(), nan=0.5)
    spec = {"format": "mxfp", "width": width, "exponent_width": ew, "block_size": block_size}
    q = _quantizer(spec)
    p = pack_weight(q, w)
    assert p.codec == "mxfp" and p.parts["scales"].dtype == torch.uint8
    assert p.parts["scales"].numel() == 16 * -(-40 // block_size)
    assert torch.equal(_bits(unpack(p)), _bits(q(w)))


def test_block_nan_is_not_packable() -> None:
    w = _weight()
    w[9, 9] = float("nan")
    for spec in ({"format": "mxint", "width": 8}, {"format": "block_fp", "width": 6},
                 {"format": "mxfp", "width": 4, "exponent_width": 2}):
        with pytest.raises(NotPackable, match="NaN"):
            pack_weight(_quantizer(spec), w)


def test_float_and_block_parts_reject_bad_params() -> None:
    w = _weight(8, 40)
    cases = {
        "minifloat": ({"format": "minifloat", "width": 8, "exponent_width": 4, "special": "fn"},
                      [{"width": 2}, {"exponent_width": 9}, {"special": "ibm"}, {"exponent_bias": 300},
                       {"width": 40}, {"exponent_width": 1, "special": "ieee"}]),
        "block": ({"format": "mxint", "width": 4},
                  [{"width": 25}, {"block_size": 0}, {"block_size": 5000}, {"axis": 2}, {"exponent_width": 0},
                   {"exponent_bias": -200}, {"flatten_from": 2}]),
        "mxfp": ({"format": "mxfp", "width": 4, "exponent_width": 2},
                 [{"width": 5}, {"exponent_width": 4}, {"block_size": 0}, {"axis": None}]),
    }
    for name, (spec, changes) in cases.items():
        p = pack_weight(_quantizer(spec), w)
        c = codec(name)
        assert p.codec == name and c.parts(p.params, p.shape)
        for change in changes:
            with pytest.raises(ValueError, match=f"packed codec {name!r}"):
                c.parts({**p.params, **change}, p.shape)
        with pytest.raises(ValueError, match="exactly"):
            c.parts({k: v for k, v in p.params.items() if k != "width"}, p.shape)
        grown = PackedTensor(name, p.params, (9, 40), p.parts)  # claims more elements than its parts hold
        with pytest.raises(ValueError, match="do not match"):
            c.unpack(grown)


# -- sizes -----------------------------------------------------------------------------------------------------
SIZE_SPECS: list[dict[str, Any]] = [
    *({"format": "minifloat", "width": b, "exponent_width": e, "special": s}
      for b, e, s in ((8, 4, "fn"), (6, 3, "ieee"), (5, 2, "none"), (3, 1, "none"))),
    *({"format": "mxint", "width": b, "block_size": s} for b in (2, 3, 4, 8) for s in (16, 32)),
    *({"format": "block_fp", "width": b, "exponent_width": e, "block_size": s}
      for b in (3, 4, 7) for e in (4, 8) for s in (16, 32)),
    *({"format": "mxfp", "width": b, "exponent_width": e, "block_size": 32}
      for b, e in ((8, 4), (8, 5), (6, 2), (6, 3), (4, 2))),
]


@pytest.mark.parametrize("spec", SIZE_SPECS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_float_and_block_bytes_match_the_accounted_bits(spec: dict[str, Any]) -> None:
    w = torch.randn(384, 1536)
    q = _quantizer(spec)
    p = pack_weight(q, w)
    accounted = get_format(spec["format"]).bits(q.params) * w.numel() / 8
    assert accounted <= p.nbytes <= 1.05 * accounted


# -- weights of real quantized models --------------------------------------------------------------------------
MODEL_FORMATS: list[dict[str, Any]] = [
    {"name": "integer", "weight_width": 4, "weight_frac_width": "auto", "bias_width": 8, "bias_frac_width": 5},
    {"name": "scaled_integer", "weight_width": 3, "weight_symmetric": False, "weight_granularity": "per_channel",
     "bias_width": 8},
    {"name": "minifloat", "weight_width": 8, "weight_exponent_width": 4, "weight_special": "fn",
     "bias_width": 6, "bias_exponent_width": 3},
    {"name": "block_fp", "weight_width": 5, "weight_exponent_width": 4, "weight_block_size": 24,
     "bias_width": 8, "bias_block_size": 24},
    {"name": "mxint", "weight_width": 4, "weight_block_size": 24, "bias_width": 8},
    {"name": "mxfp", "weight_width": 4, "weight_exponent_width": 2, "weight_block_size": 24,
     "bias_width": 6, "bias_exponent_width": 2},
]


def _swap_in_unpacked(mg: ForgeGraph) -> int:
    """Replace every quantized parameter by its packed-and-unpacked value and switch its quantizer off;
    returns how many were packed (each also checked against the quantizer alone)."""
    count = 0
    for module in mg.model.modules():
        for role, q in list(getattr(module, "quantizers", dict)().items()):
            param = getattr(module, role, None)
            if role not in ("weight", "bias") or not isinstance(param, nn.Parameter):
                continue
            p = pack_layer_weight(module, role)
            out = unpack(p)
            view = param.flatten(1) if isinstance(module, QuantizedConv2d) and role == "weight" else param
            assert torch.equal(out, q(view).reshape(param.shape)) and p.shape == tuple(param.shape)
            with torch.no_grad():
                param.copy_(out)
            q.enabled = False
            count += 1
    return count


@pytest.mark.parametrize("config", MODEL_FORMATS, ids=lambda c: c["name"])
def test_tiny_bert_weights_unpack_to_the_simulated_model(bert_graph: ForgeGraph, config: dict[str, Any]) -> None:
    rule = {"config": config}
    mg, info = quantize_transform_pass(bert_graph.copy(), {"by": "type", "linear": rule, "embedding": rule,
                                                           "layer_norm": rule})
    assert info["by_op"]["embedding"] == 3 and info["by_op"]["linear"] > 0 and info["by_op"]["layer_norm"] > 0
    inputs = bert_inputs(batch=2, seq=9)
    ref = logits(mg, inputs)
    layers = [m for m in mg.model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    assert len(layers) == info["by_op"]["linear"] + 3
    packed = _swap_in_unpacked(mg)
    assert packed >= 2 * len(layers)  # weights and biases, layer norms included
    assert torch.equal(logits(mg, inputs), ref)  # the same products as the simulated model, bit for bit


class _Convs(nn.Module):
    """Two conv layers whose flattened kernels (3 * 3 * 3 = 27, 16 * 1 * 1) leave partial blocks of 16/32."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x)))


@pytest.mark.parametrize("config", MODEL_FORMATS, ids=lambda c: c["name"])
def test_conv2d_weights_unpack_to_the_simulated_model(config: dict[str, Any]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    mg = ForgeGraph(_Convs().eval(), example_inputs=(x,), frontend="fx")
    mg, info = quantize_transform_pass(mg, {"by": "type", "conv2d": {"config": config}})
    assert info["by_op"] == {"conv2d": 2}
    with torch.no_grad():
        ref = mg(x)
    convs = [m for m in mg.model.modules() if isinstance(m, QuantizedConv2d)]
    p = pack_layer_weight(convs[0])
    assert p.shape == (16, 3, 3, 3) and p.params["flatten_from"] == 1
    assert _swap_in_unpacked(mg) == 4
    with torch.no_grad():
        assert torch.equal(mg(x), ref)
