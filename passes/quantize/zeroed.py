"""Weights that round to zero: the symptom of a fixed-point fraction width too small for a layer's range.

At 8 bits with ``frac_width`` 2 the smallest step is 0.25, and most of a pretrained transformer's weights
(standard deviation ~0.05) become exactly 0: the layer computes nothing, whatever its width. The report
and the mixed-precision search measure it with :func:`zero_fraction` and warn with
:class:`QuantizationWarning` above :data:`ZEROED_THRESHOLD`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

__all__ = ["QuantizationWarning", "ZEROED_THRESHOLD", "zero_counts", "zero_fraction", "warn_zeroed"]

ZEROED_THRESHOLD = 0.5  # a layer is "zeroed" when more than this fraction of its nonzero weights become 0


class QuantizationWarning(UserWarning):
    """A quantization config that runs but destroys a layer (e.g. most of its weights round to zero)."""


def zero_counts(weight: torch.Tensor, quantized: torch.Tensor) -> tuple[int, int]:
    """(nonzero float elements that quantize to 0, nonzero float elements): already-zero (pruned) weights
    are not counted, so a pruned layer is not taken for a zeroed one. Complex tensors count both parts."""
    w, q = weight.detach(), quantized.detach()
    if w.is_complex():
        w, q = torch.view_as_real(w), torch.view_as_real(q)
    nonzero = w != 0
    return int((nonzero & (q == 0)).sum()), int(nonzero.sum())


def zero_fraction(weight: torch.Tensor, quantized: torch.Tensor) -> float:
    """The fraction of ``weight``'s nonzero elements that ``quantized`` holds as 0 (0.0 for an all-zero one)."""
    zeroed, nonzero = zero_counts(weight, quantized)
    return zeroed / nonzero if nonzero else 0.0


def warn_zeroed(where: str, zeroed: Sequence[tuple[str, float]], stacklevel: int = 3) -> None:
    """Warn that the weights of these (name, fraction) layers mostly round to zero, and say what to do."""
    if not zeroed:
        return
    shown = ", ".join(f"{name} ({frac:.0%})" for name, frac in zeroed[:6])
    more = f" and {len(zeroed) - 6} more" if len(zeroed) > 6 else ""
    warnings.warn(f"{where}: the weights of {len(zeroed)} layer(s) mostly round to zero (more than "
                  f"{ZEROED_THRESHOLD:.0%} of their nonzero weights become 0): {shown}{more}. The fraction width "
                  "is too large a step for these weights' range: give 'weight_frac_width': 'auto' (the most "
                  "fraction bits that still cover each output row's max|w|) or a larger frac_width",
                  QuantizationWarning, stacklevel=stacklevel)
