"""GPTQ's rounding of one weight matrix (Frantar et al. 2022), written against fxforge's formats.

Columns (inputs) are quantized one at a time; each column's rounding error, scaled by the Cholesky factor
of the inverse of H = 2 XᵀX (X: the layer's calibration inputs), is fed back into the columns not yet
quantized, so later columns compensate for earlier ones. The grid is the layer's own weight format with the
scale taken from the float weight (as round-to-nearest takes it), and the elements that set that scale are
rounded to nearest and kept (pinned), so re-quantizing the result in the layer's forward reproduces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["gptq_round", "reconstruction_error"]

ColumnQuantizer = Callable[[torch.Tensor], torch.Tensor]  # (out, k) columns -> their quantized values


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹; dead inputs (zero diagonal) get diagonal 1."""
    h = h.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    diag_mean = torch.diagonal(h).mean()
    h += damp * diag_mean * torch.eye(h.shape[0], dtype=h.dtype)
    lower = torch.linalg.cholesky(h)
    h_inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(h_inv, upper=True)


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, quantize: ColumnQuantizer, pinned: torch.Tensor,
               *, damp: float = 0.01, block: int = 128, act_order: bool = False) -> torch.Tensor:
    """GPTQ-rounded ``weight`` (out, in), returned in the original column order.

    ``quantize`` rounds columns to the grid fixed from the float weight; ``pinned`` (out, in) bool marks
    elements that take their round-to-nearest value (the ones that set the grid's scale). ``act_order``
    quantizes columns in decreasing diag(H) order (inputs with the most energy first).
    """
    w = weight.detach().to(torch.float64).clone()
    h = hessian.to(torch.float64)
    rtn = quantize(weight.detach().float()).to(torch.float64)
    n = w.shape[1]
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(n)
    w, h, rtn, pinned = w[:, perm], h[perm][:, perm], rtn[:, perm], pinned[:, perm]
    u = _inverse_cholesky(h, damp)
    q = torch.zeros_like(w)
    for start in range(0, n, block):
        end = min(start + block, n)
        w1 = w[:, start:end].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[start:end, start:end]
        for i in range(end - start):
            col = w1[:, i]
            qcol = quantize(col.float().unsqueeze(1)).squeeze(1).to(torch.float64)
            qcol = torch.where(pinned[:, start + i], rtn[:, start + i], qcol)
            q[:, start + i] = qcol
            err = (col - qcol) / u1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, end:] -= err1 @ u[start:end, end:]
    out = torch.empty_like(q)
    out[:, perm] = q
    return out.to(weight.dtype)


def reconstruction_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error on the calibration inputs: ‖X(W-Q)ᵀ‖² / ‖XWᵀ‖², read from H = 2XᵀX/N."""
    h = hessian.to(torch.float64)
    d = (weight.to(torch.float64) - quantized.to(torch.float64))
    w = weight.to(torch.float64)
    num = torch.einsum("oi,ij,oj->", d, h, d)
    den = torch.einsum("oi,ij,oj->", w, h, w)
    return float(num / den) if float(den) > 0 else float(num)
