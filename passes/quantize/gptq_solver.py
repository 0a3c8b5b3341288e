"""GPTQ's rounding of one weight matrix (Frantar et al. 2022), written against fxforge's formats.

Columns (inputs) are quantized one at a time; each column's rounding error, scaled by the Cholesky factor
of the inverse of H = 2 XᵀX (X: the layer's calibration inputs), is fed back into the columns not yet
quantized, so later columns compensate for earlier ones. Columns come in groups that share a grid (all
columns for a per-tensor or per-row scale; one block of a block format): a group's grid is fixed from the
group's *current*, error-updated values when the sweep reaches its first column (in act-order, the first
one in the permuted order), as GPTQ fixes group-wise scales. The grid keeps the elements that set its scale
where they keep setting it (``gptq_grid``), so re-quantizing the result in the layer's forward reproduces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Grid", "GridFactory", "gptq_round", "reconstruction_error"]

Grid = Callable[[torch.Tensor, int], torch.Tensor]  # (group's j-th column (out,) float32, j) -> its rounding
GridFactory = Callable[[torch.Tensor], Grid]  # a group's current values (out, k) float32 -> its grid


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


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, grid: GridFactory, groups: torch.Tensor | None = None,
               *, damp: float = 0.01, block: int = 128, act_order: bool = False) -> torch.Tensor:
    """GPTQ-rounded ``weight`` (out, in), returned in the original column order.

    ``groups`` (in,) gives each column's group id (None: one group of all columns); ``grid`` builds a group's
    grid from the group's current values (its columns in increasing index order). ``act_order`` quantizes
    columns in decreasing diag(H) order (inputs with the most energy first); ``block`` columns are quantized
    between two lazy updates of the rest (speed only).
    """
    w = weight.detach().to(torch.float64).clone()
    h = hessian.to(torch.float64)
    n = w.shape[1]
    groups = torch.zeros(n, dtype=torch.long) if groups is None else groups.to(torch.long).cpu()
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(n)
    position = torch.empty_like(perm)
    position[perm] = torch.arange(n)
    members = {int(g): torch.nonzero(groups == g).flatten() for g in torch.unique(groups)}
    local = torch.empty(n, dtype=torch.long)  # a column's index inside its group
    for cols in members.values():
        local[cols] = torch.arange(len(cols))
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_cholesky(h, damp)
    q = torch.zeros_like(w)
    grids: dict[int, Grid] = {}
    for start in range(0, n, block):
        end = min(start + block, n)
        w1 = w[:, start:end].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[start:end, start:end]
        for i in range(end - start):
            column = int(perm[start + i])
            g = int(groups[column])
            if g not in grids:
                grids[g] = grid(_current(w, w1, err1, u[start:end], position[members[g]], start, i).float())
            col = w1[:, i]
            qcol = grids[g](col.float(), int(local[column])).to(torch.float64)
            q[:, start + i] = qcol
            err = (col - qcol) / u1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, end:] -= err1 @ u[start:end, end:]
    out = torch.empty_like(q)
    out[:, perm] = q
    return out.to(weight.dtype)


def _current(w: torch.Tensor, w1: torch.Tensor, err1: torch.Tensor, u_rows: torch.Tensor, pos: torch.Tensor,
             start: int, i: int) -> torch.Tensor:
    """The error-updated values of the (not yet quantized) columns at permuted positions ``pos``: those in the
    current lazy batch are up to date in ``w1``; later ones still owe the batch's errors so far (err1 @ U)."""
    end = start + w1.shape[1]
    assert bool((pos >= start + i).all()), "a group's column was quantized before its grid was fixed"
    inside = pos < end
    out = torch.empty(w.shape[0], len(pos), dtype=w.dtype)
    out[:, inside] = w1[:, pos[inside] - start]
    later = pos[~inside]
    out[:, ~inside] = w[:, later] - err1 @ u_rows[:, later]
    return out


def reconstruction_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output error on the calibration inputs: ‖X(W-Q)ᵀ‖² / ‖XWᵀ‖², read from H = 2XᵀX/N."""
    h = hessian.to(torch.float64)
    d = (weight.to(torch.float64) - quantized.to(torch.float64))
    w = weight.to(torch.float64)
    num = torch.einsum("oi,ij,oj->", d, h, d)
    den = torch.einsum("oi,ij,oj->", w, h, w)
    return float(num / den) if float(den) > 0 else float(num)
