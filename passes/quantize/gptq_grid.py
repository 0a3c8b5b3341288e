"""The grids GPTQ rounds a Linear weight onto: the layer's own format, fixed so the layer re-derives it.

* Scaled and fixed-point formats (and minifloat, whose grid is fixed): one group of all columns; the scale
  (per row or per tensor) comes from the float weight as round-to-nearest takes it (``column_quantizer``).
* Block formats (``mxint``, ``block_fp``, ``mxfp``): a block's shared exponent is fixed from the block's
  current, error-updated values when the sweep first reaches one of its columns. Blocks along the inputs
  (the layers' layout) group ``block_size`` columns; blocks along the outputs lie inside one column each.

Scaled formats pin the elements that set the scale to their rounded value and clamp the others to the
range it gives. Block formats keep every element below 2^(e+1) in magnitude (the two's-complement
``-2^(w-1)`` code only at the top exponent) and the block's largest element at start at or above 2^e:
rounded from its updated value, and moved to ±2^e if that fell below. Either way the quantizer in the
layer's forward re-derives the same grid and maps the GPTQ weight to itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .block import _blocked, _floor_log2_amax, _unblocked, mxfp_element
from .fixed import integer_range, tensor_range
from .formats import QuantContext
from .gptq_solver import Grid, GridFactory
from .minifloat import minifloat_quantize, pow2
from .quantizer import Quantize

__all__ = ["BLOCK_FORMATS", "column_quantizer", "weight_grid"]

BLOCK_FORMATS = ("mxint", "block_fp", "mxfp")


def weight_grid(wq: Quantize, shape: tuple[int, ...] | torch.Size) -> tuple[GridFactory, torch.Tensor | None]:
    """(grid of a group from its current values, each column's group id or None for one group) for an
    (out, in) weight quantized by ``wq``."""
    if wq.fmt.name not in BLOCK_FORMATS:
        return partial(_scale_grid, wq), None
    n = shape[1]
    axis = wq.block_axis % 2
    groups = torch.arange(n) // int(wq.params["block_size"]) if axis == 1 else torch.arange(n)
    return partial(_block_grid, wq, axis), groups


def column_quantizer(wq: Quantize, weight: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(quantize columns on the grid ``wq`` derives from ``weight``, elements that set that grid's scale).

    The scale (per row or per tensor) is fixed from the float weight as round-to-nearest fixes it; the pinned
    elements (the row's or tensor's max |w|, or its min and max when asymmetric) keep their rounded value so
    the grid the layer re-derives from the GPTQ weight is the same one.
    """
    w = weight.detach().float()
    ctx: QuantContext = wq._context(w, 0, 1)
    fmt, params = wq.fmt, wq.params
    ctx_cols = QuantContext(1, 0, ctx.scale, ctx.zero_point)

    ranged = fmt.scaled or wq.auto_fixed
    per_row = wq.auto_fixed or wq.per_channel
    symmetric = wq.auto_fixed or bool(params.get("symmetric", True))
    lo = hi = None
    if ranged:  # values past the float weight's rounded range would move the re-derived scale: clamp to it
        rtn = fmt.quantize(w, params, ctx_cols)
        lo, hi = tensor_range(rtn, 0 if per_row else None)
        if symmetric:
            hi = torch.maximum(lo.abs(), hi.abs())
            lo = -hi
        if per_row:
            lo, hi = lo.unsqueeze(1), hi.unsqueeze(1)

    def quantize(cols: torch.Tensor) -> torch.Tensor:
        q = fmt.quantize(cols, params, ctx_cols)
        return q if lo is None or hi is None else torch.minimum(torch.maximum(q, lo), hi)

    pinned = torch.zeros_like(w, dtype=torch.bool)
    if ranged:
        picks = [w.abs()] if symmetric else [w, -w]
        for score in picks:
            if per_row:
                pinned[torch.arange(w.shape[0]), score.argmax(dim=1)] = True
            else:
                pinned.view(-1)[score.argmax()] = True
    return quantize, pinned


def _scale_grid(wq: Quantize, values: torch.Tensor) -> Grid:
    """All columns on the scale round-to-nearest takes from ``values`` (the float weight: nothing is updated
    before the first column); the pinned elements take their rounding from ``values``."""
    quantize, pinned = column_quantizer(wq, values)
    fixed = quantize(values)

    def grid(col: torch.Tensor, j: int) -> torch.Tensor:
        return torch.where(pinned[:, j], fixed[:, j], quantize(col.unsqueeze(1)).squeeze(1))

    return grid


Rounding = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _element_rounding(wq: Quantize, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, Rounding]:
    """(scale, lowest and highest value kept, 2^e, per block; round(x, scale)) of a block format, its exponent
    e taken as the format's quantizer takes it. Kept values stay below 2^(e+1) in magnitude (the re-derived
    exponent would rise), so MXINT's -2^(w-1) code is kept only at the top exponent, where it is clamped."""
    p = wq.params
    e = _floor_log2_amax(blocks)
    if wq.fmt.name == "mxfp":
        elem = mxfp_element(p["width"], p["exponent_width"])
        scale = pow2(torch.clamp(e - elem.max_exponent, -126, 127), torch.float32)
        top = elem.max_value * scale
        return scale, -top, top, scale * 2.0**elem.max_exponent, lambda x, s: minifloat_quantize(x / s, elem) * s
    width = int(p["width"])
    ew, bias = (8, 127) if wq.fmt.name == "mxint" else (int(p["exponent_width"]), p["exponent_bias"])
    bias = 2 ** (ew - 1) - 1 if bias is None else int(bias)
    e_top = min(2**ew - 1 - bias, 127)
    e = torch.clamp(e, max(-bias, -126), e_top)
    qmin, qmax = integer_range(width)
    step = pow2(e, torch.float32) / 2.0 ** (width - 2)
    low = torch.where(e == e_top, float(qmin), float(-qmax)) * step
    return step, low, qmax * step, pow2(e, torch.float32), lambda x, s: torch.clamp(torch.round(x / s), qmin, qmax) * s


def _block_grid(wq: Quantize, axis: int, values: torch.Tensor) -> Grid:
    """The blocks inside ``values`` (out, k) with their shared exponents fixed from these values: elements kept
    within the block's range, and the block's largest element at or above 2^e where that is what set e (an
    exponent clamped from below is re-derived from any smaller values)."""
    blocks, shape, n = _blocked(values, int(wq.params["block_size"]), axis)
    scale, low, high, floor, rnd = _element_rounding(wq, blocks)
    mags = blocks.abs()
    amax = mags.amax(dim=-1, keepdim=True)
    floor = torch.where(amax >= floor, floor, torch.zeros_like(floor))
    leader = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, mags.argmax(dim=-1, keepdim=True), True)
    sign = torch.where(blocks < 0, -1.0, 1.0)
    steps, lows, highs, floors, leaders, signs = (_unblocked(t.expand_as(blocks), shape, n, axis)
                                                  for t in (scale, low, high, floor, leader, sign))

    def grid(col: torch.Tensor, j: int) -> torch.Tensor:
        q = torch.minimum(torch.maximum(rnd(col, steps[:, j]), lows[:, j]), highs[:, j])
        short = leaders[:, j] & (q.abs() < floors[:, j])
        return torch.where(short, torch.where(col == 0, signs[:, j], torch.sign(col)) * floors[:, j], q)

    return grid
