"""Triton LayerNorm over the last dim, optionally fused with the residual add before it.

One program per row (``BLOCK_SIZE`` = next power of two >= width, columns past it masked): load x
(and the residual), form the sum, mean and variance in fp32, write ``(s - mean) * rstd * w + b`` and,
for the residual form, the sum ``s`` (the next block's residual stream). Imported lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_power_of_2, row_warps


@triton.jit
def _layer_norm_fwd_kernel(y_ptr, s_ptr, x_ptr, r_ptr, w_ptr, b_ptr, n_cols, eps,
                           HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * n_cols + cols, mask=valid, other=0.0).to(tl.float32)
        tl.store(s_ptr + row * n_cols + cols, x.to(s_ptr.dtype.element_ty), mask=valid)
    mean = tl.sum(x, axis=0) / n_cols
    diff = tl.where(valid, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / n_cols + eps)
    y = diff * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=valid)


def layer_norm_fwd(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(LayerNorm(x [+ residual]), the sum or None) with the Triton kernel."""
    x = x.contiguous()
    n_cols = x.shape[-1]
    y = torch.empty_like(x)
    s = None if residual is None else torch.empty_like(x)
    rows = x.numel() // max(n_cols, 1)
    if rows and n_cols:
        block = next_power_of_2(n_cols)
        r = x if residual is None else residual.contiguous()
        _layer_norm_fwd_kernel[(rows,)](
            y, x if s is None else s, x, r, x if weight is None else weight.contiguous(),
            x if bias is None else bias.contiguous(), n_cols, float(eps),
            HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK_SIZE=block, num_warps=row_warps(block))
    return y, s
