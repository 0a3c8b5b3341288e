"""One home for comparing outputs: max abs / relative difference and SQNR over whole output pytrees.

Quantization reports, pipeline contract checks and search objectives measure error the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["OutputDiff", "compare_outputs", "signal_noise_power", "sqnr_db"]


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise); +inf for a noiseless result."""
    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


def _as_real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).float() if t.is_complex() else t.float()


def _float_pairs(ref: Any, out: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    a_leaves, b_leaves = pytree.tree_leaves(ref), pytree.tree_leaves(out)
    if len(a_leaves) != len(b_leaves):
        raise ValueError(f"outputs have different structures ({len(a_leaves)} vs {len(b_leaves)} leaves)")
    pairs = []
    for a, b in zip(a_leaves, b_leaves):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
            if a.shape != b.shape:
                raise ValueError(f"output shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
            pairs.append((_as_real(a.detach()), _as_real(b.detach())))
    return pairs


def signal_noise_power(ref: Any, out: Any) -> tuple[float, float]:
    """(sum of ref², sum of (ref - out)²) over every floating/complex tensor leaf of two output pytrees."""
    sig = noise = 0.0
    for a, b in _float_pairs(ref, out):
        sig += float((a * a).sum())
        noise += float(((a - b) ** 2).sum())
    return sig, noise


@dataclass(frozen=True)
class OutputDiff:
    """How far ``out`` is from ``ref``: largest absolute difference, largest |ref|, SQNR in dB."""

    max_abs: float
    ref_max: float
    sqnr_db: float

    def within(self, atol: float, rtol: float) -> bool:
        return self.max_abs <= atol + rtol * self.ref_max


def compare_outputs(ref: Any, out: Any) -> OutputDiff:
    """Compare two output pytrees leaf by leaf (non-float leaves must be equal)."""
    for a, b in zip(pytree.tree_leaves(ref), pytree.tree_leaves(out)):
        if isinstance(a, torch.Tensor) and not (a.is_floating_point() or a.is_complex()):
            if not isinstance(b, torch.Tensor) or not torch.equal(a, b):
                raise ValueError("integer/bool outputs differ")
    pairs = _float_pairs(ref, out)
    max_abs = max((float((a - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    ref_max = max((float(a.abs().max()) for a, _ in pairs if a.numel()), default=0.0)
    return OutputDiff(max_abs, ref_max, sqnr_db(*signal_noise_power(ref, out)))
