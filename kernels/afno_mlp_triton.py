"""Triton AFNO spectral MLP: block-diagonal complex two-layer MLP + ReLU + mode mask + softshrink.

Grid ``(row tiles, blocks)``: each program loads a ``BLOCK_R`` x ``block_size`` tile of Fourier modes
(real and imaginary parts), the block's complex weights, and computes both layers on-chip, writing the
softshrunk (real, imag) pairs once -- the chain of ~20 eager ops between the FFTs in one kernel. Tiles
of at least 16 use ``tl.dot`` (fp32 "ieee" precision), smaller ones a broadcast-multiply-sum. Imported lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_power_of_2


@triton.jit
def _mm(a, b, USE_DOT: tl.constexpr):
    if USE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _afno_mlp_fwd_kernel(z_ptr, x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, m_ptr, n_rows, n_modes, n_blocks,
                         n_in, n_hid, lambd, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_O: tl.constexpr, USE_DOT: tl.constexpr):
    pid_r = tl.program_id(0)
    k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    ii = tl.arange(0, BLOCK_I)
    oo = tl.arange(0, BLOCK_O)
    row_ok = rows < n_rows
    i_ok = ii < n_in
    o_ok = oo < n_hid
    # x is (rows, blocks, n_in, 2): real at even, imaginary at odd offsets
    x_off = rows[:, None] * (n_blocks * n_in * 2) + k * n_in * 2 + ii[None, :] * 2
    x_ok = row_ok[:, None] & i_ok[None, :]
    xr = tl.load(x_ptr + x_off, mask=x_ok, other=0.0).to(tl.float32)
    xi = tl.load(x_ptr + x_off + 1, mask=x_ok, other=0.0).to(tl.float32)
    # w1 is (2, blocks, n_in, n_hid); w2 is (2, blocks, n_hid, n_in)
    w1_off = k * n_in * n_hid + ii[:, None] * n_hid + oo[None, :]
    w1_ok = i_ok[:, None] & o_ok[None, :]
    w1r = tl.load(w1_ptr + w1_off, mask=w1_ok, other=0.0).to(tl.float32)
    w1i = tl.load(w1_ptr + n_blocks * n_in * n_hid + w1_off, mask=w1_ok, other=0.0).to(tl.float32)
    b1r = tl.load(b1_ptr + k * n_hid + oo, mask=o_ok, other=0.0).to(tl.float32)
    b1i = tl.load(b1_ptr + n_blocks * n_hid + k * n_hid + oo, mask=o_ok, other=0.0).to(tl.float32)
    keep = tl.load(m_ptr + rows % n_modes, mask=row_ok, other=0.0).to(tl.float32)[:, None]

    o1r = tl.maximum(_mm(xr, w1r, USE_DOT) - _mm(xi, w1i, USE_DOT) + b1r[None, :], 0.0) * keep
    o1i = tl.maximum(_mm(xi, w1r, USE_DOT) + _mm(xr, w1i, USE_DOT) + b1i[None, :], 0.0) * keep

    w2_off = k * n_hid * n_in + oo[:, None] * n_in + ii[None, :]
    w2_ok = o_ok[:, None] & i_ok[None, :]
    w2r = tl.load(w2_ptr + w2_off, mask=w2_ok, other=0.0).to(tl.float32)
    w2i = tl.load(w2_ptr + n_blocks * n_hid * n_in + w2_off, mask=w2_ok, other=0.0).to(tl.float32)
    b2r = tl.load(b2_ptr + k * n_in + ii, mask=i_ok, other=0.0).to(tl.float32)
    b2i = tl.load(b2_ptr + n_blocks * n_in + k * n_in + ii, mask=i_ok, other=0.0).to(tl.float32)
    o2r = (_mm(o1r, w2r, USE_DOT) - _mm(o1i, w2i, USE_DOT) + b2r[None, :]) * keep
    o2i = (_mm(o1i, w2r, USE_DOT) + _mm(o1r, w2i, USE_DOT) + b2i[None, :]) * keep

    zr = tl.where(o2r > lambd, o2r - lambd, tl.where(o2r < -lambd, o2r + lambd, 0.0))
    zi = tl.where(o2i > lambd, o2i - lambd, tl.where(o2i < -lambd, o2i + lambd, 0.0))
    tl.store(z_ptr + x_off, zr.to(z_ptr.dtype.element_ty), mask=x_ok)
    tl.store(z_ptr + x_off + 1, zi.to(z_ptr.dtype.element_ty), mask=x_ok)


def afno_mlp_fwd(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 mode_mask: torch.Tensor, lambd: float) -> torch.Tensor:
    """The fused AFNO spectral MLP on ``x`` of shape (B, M, K, I, 2) with the Triton kernel."""
    x = x.contiguous()
    batch, modes, blocks, n_in, _ = x.shape
    n_hid = w1.shape[-1]
    z = torch.empty_like(x)
    rows = batch * modes
    if rows == 0:
        return z
    block_i, block_o = next_power_of_2(n_in), next_power_of_2(n_hid)
    use_dot = block_i >= 16 and block_o >= 16
    block_r = 16 if use_dot else max(1, min(16, 4096 // (block_i * block_o)))
    grid = (triton.cdiv(rows, block_r), blocks)
    _afno_mlp_fwd_kernel[grid](z, x, w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous(),
                               mode_mask.contiguous(), rows, modes, blocks, n_in, n_hid, float(lambd),
                               BLOCK_R=block_r, BLOCK_I=block_i, BLOCK_O=block_o, USE_DOT=use_dot)
    return z
