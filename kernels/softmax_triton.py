"""Triton row softmax (MASE tutorial 9 / Triton's fused-softmax tutorial), optionally scaled and masked.

One program per row: the row is loaded into SRAM once (``BLOCK_SIZE`` = the next power of two >= the
row width; the columns past the width are masked and read as -inf so they add exp(-inf) = 0), max,
subtract, exp, sum and divide happen on-chip in fp32, and the result is written once. Imported lazily
by kernels/row_softmax.py (never at ``import fxforge``), so ``TRITON_INTERPRET`` is honoured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_power_of_2, row_warps


@triton.jit
def _softmax_fwd_kernel(out_ptr, in_ptr, mask_ptr, n_cols, scale, d1, d2,
                        ms0, ms1, ms2, msc, HAS_MASK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    valid = cols < n_cols
    x = tl.load(in_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        i2 = row % d2
        i1 = (row // d2) % d1
        i0 = row // (d2 * d1)
        m = tl.load(mask_ptr + i0 * ms0 + i1 * ms1 + i2 * ms2 + cols * msc, mask=valid, other=0.0)
        x = x + m.to(tl.float32)
    x = tl.where(valid, x, -float("inf"))
    z = x - tl.max(x, axis=0)
    num = tl.exp(z)
    y = num / tl.sum(num, axis=0)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _softmax_bwd_kernel(dz_ptr, y_ptr, dy_ptr, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    valid = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    dz = y * (dy - tl.sum(y * dy, axis=0))
    tl.store(dz_ptr + row * n_cols + cols, dz.to(dz_ptr.dtype.element_ty), mask=valid)


def _mask_4d(mask: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, ...]]:
    """The mask expanded to ``shape`` (stride 0 where it broadcasts) as 3 leading dims + columns."""
    expanded = mask.expand(shape)
    lead = tuple(shape[:-1])
    if len(lead) > 3:
        expanded = expanded.contiguous().reshape(1, 1, -1, shape[-1])
    else:
        expanded = expanded[(None,) * (3 - len(lead))]
    _, d1, d2, _ = expanded.shape
    return expanded, (d1, d2, 0), tuple(expanded.stride())


def softmax_fwd(x: torch.Tensor, mask: torch.Tensor | None, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """softmax(x * scale + mask) over the last dim with the Triton kernel, written as ``out_dtype``."""
    x = x.contiguous()
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x.numel() // max(n_cols, 1)
    if rows == 0 or n_cols == 0:
        return out
    block = next_power_of_2(n_cols)
    if mask is not None:
        m4, (d1, d2, _), strides = _mask_4d(mask, x.shape)
        _softmax_fwd_kernel[(rows,)](out, x, m4, n_cols, float(scale), d1, d2, *strides,
                                     HAS_MASK=True, BLOCK_SIZE=block, num_warps=row_warps(block))
    else:
        _softmax_fwd_kernel[(rows,)](out, x, x, n_cols, float(scale), 1, 1, 0, 0, 0, 0,
                                     HAS_MASK=False, BLOCK_SIZE=block, num_warps=row_warps(block))
    return out


def softmax_bwd(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. the softmax input: ``y * (dy - sum(y * dy))`` row by row."""
    y, dy = y.contiguous(), dy.contiguous()
    n_cols = y.shape[-1]
    dz = torch.empty_like(y)
    rows = y.numel() // max(n_cols, 1)
    if rows == 0 or n_cols == 0:
        return dz
    block = next_power_of_2(n_cols)
    _softmax_bwd_kernel[(rows,)](dz, y, dy, n_cols, BLOCK_SIZE=block, num_warps=row_warps(block))
    return dz
