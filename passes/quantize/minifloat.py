"""Minifloat: generic small floating point (sign, E exponent bits, M mantissa bits, bias).

Special values (``special``):

* ``"ieee"`` -- the top exponent holds inf/NaN (IEEE style; OCP FP8 E5M2 is E5M2 "ieee").
* ``"fn"``   -- finite-only except one NaN code (all-ones exponent and mantissa), the top exponent is
  otherwise normal (OCP FP8 E4M3 is E4M3 "fn", torch's ``float8_e4m3fn``).
* ``"none"`` -- every code is a finite number (MASE's ``minifloat_denorm``; OCP FP6/FP4 elements).

Rounding is round-to-nearest-even with subnormals. ``saturate=True`` is OCP's "satfinite": finite
values beyond the largest normal and +-inf clamp to +-max; ``saturate=False`` overflows to inf
("ieee") or NaN ("fn"); "none" has neither, so it always saturates. NaN stays NaN; the sign of zero
is kept.

torch 2.13's casts, verified bit for bit over dense sweeps in the tests: ``float8_e4m3fn`` equals
E4M3 "fn" with ``saturate=True`` (torch saturates out-of-range values and inf to +-448), and
``float8_e5m2`` equals E5M2 "ieee" with ``saturate=False`` (torch overflows to inf); E5M2 with
``saturate=True`` equals torch on every in-range value and clamps the rest to +-57344.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fixed import straight_through

__all__ = ["MinifloatFormat", "SPECIALS", "minifloat_quantize", "FP8_E4M3", "FP8_E5M2", "pow2"]

SPECIALS: tuple[str, ...] = ("ieee", "fn", "none")


@dataclass(frozen=True)
class MinifloatFormat:
    """A minifloat format; ``exponent_bias`` None means the IEEE bias ``2^(E-1) - 1``."""

    exponent_width: int
    mantissa_width: int
    exponent_bias: int | None = None
    special: str = "ieee"
    saturate: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.exponent_width <= 8:
            raise ValueError(f"exponent_width must be in [1, 8], got {self.exponent_width}")
        if not 0 <= self.mantissa_width <= 23:
            raise ValueError(f"mantissa_width must be in [0, 23], got {self.mantissa_width}")
        if self.special not in SPECIALS:
            raise ValueError(f"special must be one of {list(SPECIALS)}, got {self.special!r}")
        if self.special == "ieee" and self.exponent_width < 2:
            raise ValueError("special='ieee' needs exponent_width >= 2 (the top exponent is reserved)")
        if self.special == "fn" and self.exponent_width + self.mantissa_width < 2:
            raise ValueError("special='fn' needs at least 2 exponent+mantissa bits")
        if self.min_exponent - self.mantissa_width < -149 or self.max_exponent > 127:
            raise ValueError(f"exponent range [{self.min_exponent}, {self.max_exponent}] (bias {self.bias}) "
                             "does not fit float32, in which results are returned")

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_width - 1) - 1 if self.exponent_bias is None else self.exponent_bias

    @property
    def width(self) -> int:
        return 1 + self.exponent_width + self.mantissa_width

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number (subnormals share it)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """Exponent of the largest finite number."""
        top = 2**self.exponent_width - 1
        return top - 1 - self.bias if self.special == "ieee" else top - self.bias

    @property
    def max_value(self) -> float:
        """Largest finite magnitude."""
        m = self.mantissa_width
        if self.special == "fn":  # all-ones mantissa at the top exponent is NaN
            frac = (2**m - 2) / 2**m if m > 0 else None
            if frac is None:  # M = 0: the top exponent is only NaN; max is the exponent below
                return 2.0 ** (self.max_exponent - 1)
            return (1.0 + frac) * 2.0**self.max_exponent
        return (2.0 - 2.0**-m) * 2.0**self.max_exponent

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_width)


FP8_E4M3 = MinifloatFormat(4, 3, special="fn", saturate=True)
FP8_E5M2 = MinifloatFormat(5, 2, special="ieee", saturate=False)


def pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2.0 ** e`` for an integer tensor ``e`` (normal range of ``dtype``) built from bits."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _work_dtype(fmt: MinifloatFormat) -> torch.dtype:
    """float32 when every quantum and rescale factor of ``fmt`` is a normal float32, else float64."""
    lo = fmt.min_exponent - fmt.mantissa_width
    hi = fmt.max_exponent + 1 - fmt.mantissa_width
    return torch.float32 if lo >= -126 and hi <= 127 and fmt.mantissa_width - fmt.min_exponent <= 127 \
        else torch.float64


def minifloat_quantize(x: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even); returns ``x``'s dtype.

    Gradient: straight-through inside ``[-max, max]``, 0 on saturated values.
    """
    work = _work_dtype(fmt)
    m = fmt.mantissa_width
    max_value = fmt.max_value
    with torch.no_grad():
        a = x.detach().abs().to(work)
        _, e = torch.frexp(a)  # a = f * 2^e, f in [0.5, 1): floor(log2 a) = e - 1
        e = torch.clamp(e - 1, fmt.min_exponent, fmt.max_exponent + 1)
        quantum = e - m
        q = torch.round(a * pow2(-quantum, work)) * pow2(quantum, work)
        over = q > max_value
        if fmt.saturate or fmt.special == "none":
            q = torch.where(over, torch.full_like(q, max_value), q)
        else:
            q = torch.where(over, torch.full_like(q, float("inf") if fmt.special == "ieee" else float("nan")), q)
        q = torch.copysign(q, x.detach().to(work)).to(x.dtype)
    return straight_through(x, q, x.abs() <= max_value)
