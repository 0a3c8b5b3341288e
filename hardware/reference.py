"""The integer arithmetic the emitted RTL does, in torch int64: ``integer_forward`` and its pieces.

``quantize_input`` repeats the fixed-point quantizer's float ops on the graph input (so the integers are
the ones the quantized model sees); ``requantize`` moves an integer from one fixed-point format to another
with round-half-to-even and saturation (``torch.round`` then ``clamp``, as ``fixed_point_quantize``); a
Linear accumulates exactly in its accumulator format. The result equals the quantized model's output
(dequantized: ``ints * 2^-frac``) exactly whenever the model's own float arithmetic is exact (float64: any
accumulator up to 53 bits; float32: up to 24).
"""

from __future__ import annotations

import torch

from .ir import Fixed, HwGraph, HwLayer

__all__ = ["quantize_input", "requantize", "integer_forward", "dequantize"]


def quantize_input(x: torch.Tensor, fmt: Fixed) -> torch.Tensor:
    """The integers of ``fixed_point_quantize(x, width, frac)`` (the same float32 ops), as int64."""
    q = torch.clamp(torch.round(x.float() * 2.0**fmt.frac), fmt.qmin, fmt.qmax)
    return q.to(torch.int64)


def _round_shift(v: torch.Tensor, s: int) -> torch.Tensor:
    """``round_half_even(v / 2^s)`` for s >= 1 (|v| < 2^62)."""
    if s > 62:  # |v| < 2^(s-1): every value rounds to 0
        return torch.zeros_like(v)
    floor = v >> s
    rem = v - (floor << s)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((floor & 1) == 1))
    return floor + up.to(v.dtype)


def requantize(v: torch.Tensor, src: Fixed, dst: Fixed) -> torch.Tensor:
    """``v`` (integers of format ``src``) in format ``dst``: round half to even, then saturate."""
    shift = dst.frac - src.frac
    if shift < 0:
        v = _round_shift(v, -shift)
    elif shift > 0:
        if shift >= dst.width:  # any nonzero value saturates
            return torch.where(v > 0, dst.qmax, torch.where(v < 0, dst.qmin, 0)).to(v.dtype)
        bound = 1 << (dst.width - shift)  # beyond it the shifted value saturates anyway (no int64 overflow)
        v = torch.clamp(v, -bound, bound) << shift
    return torch.clamp(v, dst.qmin, dst.qmax)


def _linear(layer: HwLayer, x: torch.Tensor, x_fmt: Fixed) -> torch.Tensor:
    assert layer.weight is not None and layer.weight_fmt is not None
    acc = layer.fmt
    prod_shift = acc.frac - x_fmt.frac - layer.weight_fmt.frac
    y = (x @ layer.weight.T) << prod_shift
    if layer.bias is not None and layer.bias_fmt is not None:
        y = y + (layer.bias << (acc.frac - layer.bias_fmt.frac))
    return y


def _align(v: torch.Tensor, src: Fixed, frac: int) -> torch.Tensor:
    return v << (frac - src.frac)


def integer_forward(hw: HwGraph, x_int: torch.Tensor) -> torch.Tensor:
    """The hardware's output integers for input integers ``x_int`` (batch, features) in the input format.

    An argmax output is the index; any other output is the integers of the last layer's format.
    """
    vals: dict[str, torch.Tensor] = {}
    for name, layer in hw.layers.items():
        ins = [vals[i] for i in layer.inputs]
        fmts = [hw.layers[i].fmt for i in layer.inputs]
        if layer.kind == "input":
            vals[name] = x_int.to(torch.int64)
        elif layer.kind == "requant":
            vals[name] = requantize(ins[0], fmts[0], layer.fmt)
        elif layer.kind == "linear":
            vals[name] = _linear(layer, ins[0], fmts[0])
        elif layer.kind == "relu":
            vals[name] = torch.clamp(ins[0], min=0)
        elif layer.kind == "add":
            vals[name] = _align(ins[0], fmts[0], layer.fmt.frac) + _align(ins[1], fmts[1], layer.fmt.frac)
        elif layer.kind == "argmax":
            vals[name] = torch.argmax(ins[0], dim=-1, keepdim=True)  # first maximum, as torch and the RTL
        else:
            raise ValueError(f"layer {name!r}: unknown kind {layer.kind!r}")
    return vals[hw.output]


def dequantize(hw: HwGraph, y_int: torch.Tensor) -> torch.Tensor:
    """Output integers as the values the quantized model returns (an argmax index stays an index)."""
    out = hw.layers[hw.output]
    if out.kind == "argmax":
        return y_int.squeeze(-1)
    return y_int.double() * 2.0 ** (-out.fmt.frac)
