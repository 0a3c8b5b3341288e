"""Block formats: one shared power-of-two scale per block of ``block_size`` values along an axis.

* Block floating point (MASE's ``block_fp``) and **MXINT** (OCP MX v1.0): elements are signed
  fixed point with ``width`` bits, ``width - 2`` of them fractional (MXINT8: 1 sign, 1 integer, 6
  fraction bits), so an element lies in ``[-2, 2 - 2^-(w-2)]``. The shared exponent is
  ``floor(log2(max |x|))`` of the block, clamped to what ``exponent_width`` bits with
  ``exponent_bias`` can hold (E8M0: ``[-127, 127]``).
* **MXFP** (OCP MX v1.0): elements are minifloats (FP8 E4M3/E5M2, FP6 E2M3/E3M2, FP4 E2M1), the
  shared scale is ``2^(floor(log2(max |x|)) - emax_elem)`` and elements are converted with
  saturation, as the spec prescribes.

Blocks run along ``axis`` (the reduction dimension of the consuming matmul); a ragged last block is
zero-padded (zeros never change a block's maximum). Scales below ``2^-126`` (float32 subnormals) are
clamped to ``2^-126``: this only matters for blocks whose largest magnitude is below ``2^-126``.
NaN elements stay NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fixed import integer_range, straight_through
from .minifloat import MinifloatFormat, minifloat_quantize, pow2

__all__ = ["block_fp_quantize", "mxint_quantize", "mxfp_quantize", "MXFP_ELEMENTS", "mxfp_element"]

# (width, exponent_width) -> element minifloat of the OCP MX spec.
MXFP_ELEMENTS: dict[tuple[int, int], MinifloatFormat] = {
    (8, 4): MinifloatFormat(4, 3, special="fn", saturate=True),
    (8, 5): MinifloatFormat(5, 2, special="ieee", saturate=True),
    (6, 2): MinifloatFormat(2, 3, special="none", saturate=True),
    (6, 3): MinifloatFormat(3, 2, special="none", saturate=True),
    (4, 2): MinifloatFormat(2, 1, special="none", saturate=True),
}


def mxfp_element(width: int, exponent_width: int) -> MinifloatFormat:
    """The OCP MX element format for (width, exponent_width); ValueError listing the valid pairs."""
    fmt = MXFP_ELEMENTS.get((width, exponent_width))
    if fmt is None:
        raise ValueError(f"no MXFP element format with width={width}, exponent_width={exponent_width}; "
                         f"OCP MX defines (width, exponent_width) in {sorted(MXFP_ELEMENTS)}")
    return fmt


def _blocked(x: torch.Tensor, block_size: int, axis: int) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """``x`` moved so ``axis`` is last, zero-padded and reshaped to (..., blocks, block_size)."""
    moved = x.movedim(axis, -1)
    n = moved.shape[-1]
    pad = (-n) % block_size
    if pad:
        moved = F.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], -1, block_size), tuple(moved.shape), n


def _unblocked(b: torch.Tensor, shape: tuple[int, ...], n: int, axis: int) -> torch.Tensor:
    return b.reshape(shape)[..., :n].movedim(-1, axis)


def _floor_log2_amax(blocks: torch.Tensor) -> torch.Tensor:
    """floor(log2(max |block|)) per block (an all-zero block gives -1; its elements stay 0)."""
    _, e = torch.frexp(blocks.abs().amax(dim=-1, keepdim=True).float())
    return e - 1


def block_fp_quantize(x: torch.Tensor, width: int, exponent_width: int = 8, exponent_bias: int | None = None,
                      block_size: int = 32, axis: int = -1) -> torch.Tensor:
    """Block floating point: shared exponent per block, ``width``-bit fixed-point elements."""
    if not 2 <= width <= 24:
        raise ValueError(f"block_fp width must be in [2, 24], got {width}")
    bias = 2 ** (exponent_width - 1) - 1 if exponent_bias is None else exponent_bias
    qmin, qmax = integer_range(width)
    frac = width - 2
    with torch.no_grad():
        blocks, shape, n = _blocked(x.detach().float(), block_size, axis)
        e = torch.clamp(_floor_log2_amax(blocks), max(-bias, -126), min(2**exponent_width - 1 - bias, 127))
        step = pow2(e, torch.float32) / 2.0**frac  # exact: a power of two, normal or subnormal
        q = torch.clamp(torch.round(blocks / step), qmin, qmax) * step
        hi = qmax * step
        inside = (blocks >= qmin * step) & (blocks <= hi)
        q = _unblocked(q, shape, n, axis).to(x.dtype)
        mask = _unblocked(inside, shape, n, axis)
    return straight_through(x, q, mask)


def mxint_quantize(x: torch.Tensor, width: int = 8, block_size: int = 32, axis: int = -1) -> torch.Tensor:
    """OCP MXINT: E8M0 shared scale per ``block_size`` values, ``width``-bit two's complement elements."""
    return block_fp_quantize(x, width, exponent_width=8, exponent_bias=127, block_size=block_size, axis=axis)


def mxfp_quantize(x: torch.Tensor, width: int = 8, exponent_width: int = 4, block_size: int = 32,
                  axis: int = -1) -> torch.Tensor:
    """OCP MXFP: E8M0 shared scale ``2^(floor(log2 amax) - emax_elem)`` and minifloat elements."""
    elem = mxfp_element(width, exponent_width)
    with torch.no_grad():
        blocks, shape, n = _blocked(x.detach().float(), block_size, axis)
        e = torch.clamp(_floor_log2_amax(blocks) - elem.max_exponent, -126, 127)
        scale = pow2(e, torch.float32)
        q = minifloat_quantize(blocks / scale, elem) * scale
        inside = blocks.abs() <= elem.max_value * scale
        q = _unblocked(q, shape, n, axis).to(x.dtype)
        mask = _unblocked(inside, shape, n, axis)
    return straight_through(x, q, mask)
