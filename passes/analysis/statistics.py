"""Streaming tensor statistics for profile_statistics_analysis_pass, under MASE's statistic names.

Each statistic sees a tensor at a time (a weight once, an activation once per calibration batch) and keeps
constant memory: counts, float64 sums and extremes, and for quantiles a fixed-size uniform sample (exact
while the values seen fit in it). Names and result keys are MASE's (``range_min_max`` -> min, max, range,
count; ``variance_online`` / ``variance_precise`` -> mean, variance, count; ``range_n_sigma``;
``range_quantile``; ``abs_mean``), so configs and readers carry over. Reduction is over every dimension
(MASE's ``dims: "all"``); ``record`` (every value kept) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...graph.metadata import MetaRecord, register_record

__all__ = ["STATISTICS", "StatisticsRecord", "Statistic", "make_statistic"]

Values = dict[str, float | int]


@register_record("software.statistics")
@dataclass
class StatisticsRecord(MetaRecord):
    """stats[entry][statistic] = {result key: value}; entries are the node's software entries
    (``data_in_0``, ``weight``, ``data_out_0``...)."""

    stats: dict[str, dict[str, Values]] = field(default_factory=dict)


class Statistic:
    """One running statistic: ``update(tensor)`` per tensor seen, ``result()`` at the end."""

    name = ""

    def __init__(self, abs: bool = False) -> None:  # noqa: A002 -- MASE's key
        self.abs = abs

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(torch.float64).flatten()
        return t.abs() if self.abs else t

    def update(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def result(self) -> Values:
        raise NotImplementedError


class RangeMinMax(Statistic):
    name = "range_min_max"

    def __init__(self, abs: bool = False) -> None:  # noqa: A002
        super().__init__(abs)
        self.count, self.min, self.max = 0, math.inf, -math.inf

    def update(self, t: torch.Tensor) -> None:
        t = self._prepare(t)
        if t.numel():
            self.count += t.numel()
            self.min, self.max = min(self.min, t.min().item()), max(self.max, t.max().item())

    def result(self) -> Values:
        return {"min": self.min, "max": self.max, "range": self.max - self.min, "count": self.count}


class Variance(Statistic):
    """Mean and population variance (MASE divides by the count), merged batch by batch (Chan et al.)."""

    name = "variance_online"

    def __init__(self, abs: bool = False) -> None:  # noqa: A002
        super().__init__(abs)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, t: torch.Tensor) -> None:
        t = self._prepare(t)
        n = t.numel()
        if not n:
            return
        mean = t.mean().item()
        m2 = ((t - mean) ** 2).sum().item()
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def result(self) -> Values:
        return {"mean": self.mean, "variance": self.m2 / self.count if self.count else math.nan, "count": self.count}


class VariancePrecise(Variance):
    name = "variance_precise"  # MASE concatenates every sample; the merged float64 moments give the same numbers


class RangeNSigma(Variance):
    name = "range_n_sigma"

    def __init__(self, abs: bool = False, num_sigma: float = 3, var_mode: str = "online") -> None:  # noqa: A002
        super().__init__(abs)
        if var_mode not in ("online", "precise"):
            raise ValueError(f"range_n_sigma: var_mode must be 'online' or 'precise', got {var_mode!r}")
        self.num_sigma = float(num_sigma)

    def result(self) -> Values:
        moments = super().result()
        sigma = math.sqrt(moments["variance"])
        lo, hi = moments["mean"] - self.num_sigma * sigma, moments["mean"] + self.num_sigma * sigma
        return {"min": lo, "max": hi, "range": hi - lo, "count": self.count}


class RangeQuantile(Statistic):
    """The ``1 - quantile`` and ``quantile`` quantiles of a uniform sample of at most ``capacity`` values
    (the values with the smallest random keys, seeded): exact while every value fits."""

    name = "range_quantile"

    def __init__(self, abs: bool = False, quantile: float = 0.975, capacity: int = 1 << 16,  # noqa: A002
                 seed: int = 0) -> None:
        super().__init__(abs)
        if not 0.5 <= quantile <= 1:
            raise ValueError(f"range_quantile: quantile must be in [0.5, 1], got {quantile}")
        if capacity < 1:
            raise ValueError(f"range_quantile: capacity must be >= 1, got {capacity}")
        self.quantile, self.capacity, self.count = float(quantile), int(capacity), 0
        self.gen = torch.Generator().manual_seed(seed)
        self.values = torch.empty(0, dtype=torch.float64)
        self.keys = torch.empty(0, dtype=torch.float64)

    def update(self, t: torch.Tensor) -> None:
        t = self._prepare(t)
        self.count += t.numel()
        keys = torch.cat([self.keys, torch.rand(t.numel(), generator=self.gen, dtype=torch.float64)])
        values = torch.cat([self.values, t])
        if values.numel() > self.capacity:
            keys, kept = torch.topk(keys, self.capacity, largest=False)
            values = values[kept]
        self.keys, self.values = keys, values

    def result(self) -> Values:
        lo, hi = (torch.quantile(self.values, q).item() for q in (1 - self.quantile, self.quantile))
        return {"min": lo, "max": hi, "range": hi - lo, "count": self.count,
                "exact": int(self.count <= self.capacity)}


class AbsMean(Statistic):
    name = "abs_mean"

    def __init__(self) -> None:
        super().__init__(abs=True)
        self.count, self.total = 0, 0.0

    def update(self, t: torch.Tensor) -> None:
        t = self._prepare(t)
        self.count += t.numel()
        self.total += t.sum().item()

    def result(self) -> Values:
        return {"abs_mean": self.total / self.count if self.count else math.nan, "count": self.count}


STATISTICS: dict[str, type[Statistic]] = {c.name: c for c in (RangeMinMax, Variance, VariancePrecise, RangeNSigma,
                                                              RangeQuantile, AbsMean)}
_IGNORED = ("device",)  # MASE moves samples to a device; fxforge reduces where the tensor is


def make_statistic(name: str, options: Mapping[str, Any]) -> Statistic:
    """A fresh statistic from MASE's ``{name: {option: value}}`` config; ValueError naming what is wrong."""
    if name == "record":
        raise ValueError("statistic 'record' keeps every value seen; fxforge's statistics are streamed: use "
                         "range_quantile (a bounded sample) or range_min_max")
    if name not in STATISTICS:
        raise ValueError(f"unknown statistic {name!r}; known: {sorted(STATISTICS)}")
    opts = {k: v for k, v in options.items() if k not in _IGNORED}
    dims = opts.pop("dims", "all")
    if dims != "all":
        raise ValueError(f"{name}: dims={dims!r}: fxforge reduces over every dimension (dims 'all') only")
    try:
        return STATISTICS[name](**opts)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None
