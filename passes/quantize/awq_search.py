"""AWQ's searches (Lin et al. 2023) for one group of linears reading the same input, on fxforge's own quantizers.

Statistics come from the float graph's calibration run: per input channel mean |x| and H = XᵀX / N. The output
error of a weight W quantized to an effective weight Q is ‖X(W-Q)ᵀ‖² = tr((W-Q) H (W-Q)ᵀ) · N, so no activation
is kept. For a scale s = mean|x|^α (normalised by sqrt(max·min)), each member's effective weight is
Q(W·diag(s))·diag(1/s) with Q the layer's own weight quantizer; α = 0 is round-to-nearest, so the chosen α is
never worse than it on the calibration data. The optional clip search then clamps each output row of the
scaled weight to a fraction of its max |w| before quantization, kept only where it lowers the error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["InputStats", "ScaleChoice", "search_scale", "search_clip"]

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # a weight quantizer: float weight -> its quantized value


@dataclass
class InputStats:
    """Running sums over a group's input rows: Σ|x| per channel, Σ xᵀx, and the row count."""

    abs_sum: torch.Tensor
    gram: torch.Tensor
    rows: int = 0

    @classmethod
    def empty(cls, channels: int) -> InputStats:
        return cls(torch.zeros(channels, dtype=torch.float64), torch.zeros(channels, channels, dtype=torch.float64))

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.abs_sum += x.abs().sum(0).cpu()
        self.gram += (x.T @ x).cpu()
        self.rows += x.shape[0]

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)

    @property
    def hessian(self) -> torch.Tensor:
        """H = XᵀX / N in float32 (the search's error metric; relative errors need no more precision)."""
        return (self.gram / max(self.rows, 1)).float()


@dataclass(frozen=True)
class ScaleChoice:
    """The chosen α, its scale s (float64, per input channel), and per member the relative output error
    ‖X(W-Q)ᵀ‖² / ‖XWᵀ‖² of round-to-nearest (α = 0) and of the chosen scale."""

    alpha: float
    scale: torch.Tensor
    rtn: list[float]
    awq: list[float]


def row_errors(weight: torch.Tensor, effective: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per output row, ‖X(w-q)ᵀ‖² / N read from H."""
    d = weight.float() - effective.float()
    return ((d @ h) * d).sum(1)


def _energy(weight: torch.Tensor, h: torch.Tensor) -> float:
    w = weight.float()
    return max(float(((w @ h) * w).sum()), 1e-30)


def scale_for(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^α, normalised so max(s)·min(s) = 1 (float64; dead channels count as 1e-4)."""
    s = mean_abs.double().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _effective(weight: torch.Tensor, quantize: Quantizer, s: torch.Tensor) -> torch.Tensor:
    """Q(W·diag(s))·diag(1/s): what the scaled layer computes on the unscaled input."""
    sf = s.to(weight.dtype)
    return quantize(weight * sf) / sf


@torch.no_grad()
def search_scale(weights: Sequence[torch.Tensor], quantizers: Sequence[Quantizer], stats: InputStats,
                 grid: int) -> ScaleChoice:
    """The α in linspace(0, 1, grid) minimising the group's summed output error (first minimum kept)."""
    h = stats.hessian
    energy = [_energy(w, h) for w in weights]
    best: tuple[float, float, torch.Tensor, list[float]] | None = None
    rtn: list[float] = []
    for alpha in torch.linspace(0.0, 1.0, grid, dtype=torch.float64).tolist() if grid > 1 else [0.0]:
        s = scale_for(stats.mean_abs, alpha)
        errs = [float(row_errors(w, _effective(w, q, s), h).sum()) for w, q in zip(weights, quantizers)]
        if not rtn:
            rtn = errs
        total = sum(errs)
        if best is None or total < best[0]:
            best = (total, alpha, s, errs)
    assert best is not None
    _, alpha, s, errs = best
    return ScaleChoice(alpha, s, [e / n for e, n in zip(rtn, energy)], [e / n for e, n in zip(errs, energy)])


@torch.no_grad()
def search_clip(weight: torch.Tensor, scaled: torch.Tensor, quantize: Quantizer, s: torch.Tensor, stats: InputStats,
                ratios: Sequence[float]) -> tuple[torch.Tensor, float]:
    """(the scaled weight with each row clamped to ±ratio·max|row| at its best ratio, the relative error after).

    ``weight`` is the float weight the error is measured against, ``scaled`` = weight·diag(s) the layer will
    hold. Rows are chosen independently; the clamped weight is returned only when the whole matrix's error is
    lower than unclipped (quantizers whose scale spans several rows couple them).
    """
    h = stats.hessian
    sf = s.to(scaled.dtype)
    row_max = scaled.abs().amax(dim=1, keepdim=True)
    base = row_errors(weight, quantize(scaled) / sf, h)
    best_err, best = base.clone(), scaled.clone()
    for r in ratios:
        cand = torch.maximum(torch.minimum(scaled, r * row_max), -r * row_max)
        err = row_errors(weight, quantize(cand) / sf, h)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best[better] = cand[better]
    total = float(row_errors(weight, quantize(best) / sf, h).sum())
    energy = _energy(weight, h)
    if total < float(base.sum()):
        return best, total / energy
    return scaled, float(base.sum()) / energy
