"""The one timing helper for benchmarks and examples: interleaved repetitions, medians, pairwise ratios.

Variants run in rounds; within a round every variant runs once and the order rotates every round, so
load drift on a shared machine hits all variants alike. Warm-up rounds (allocator, packed weights,
optimizer state) are not timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Timings", "interleaved", "best_time"]


@dataclass(frozen=True)
class Timings:
    """Seconds per variant and repetition, in run order."""

    times: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(ts) for name, ts in self.times.items()}

    def ratio(self, num: str, den: str) -> float:
        """Median of ``num`` / median of ``den``."""
        return self.median(num) / self.median(den)

    def pair_ratio(self, num: str, den: str) -> float:
        """Median of the per-round ratios (robust to drift between rounds)."""
        return statistics.median(a / b for a, b in zip(self.times[num], self.times[den]))


def interleaved(variants: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 2,
                rotate: bool = True) -> Timings:
    """Time each zero-argument callable ``repeats`` times, interleaved (see module docstring).

    A callable returning a float reports its own duration (e.g. a training step timing only its
    compute); anything else is timed around the call.
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names):] + names[:i % len(names)] if rotate else names
        for name in order:
            start = time.perf_counter()
            out = variants[name]()
            elapsed = time.perf_counter() - start
            times[name].append(out if isinstance(out, float) else elapsed)
    return Timings(times)


def best_time(fn: Callable[[], Any], repeats: int = 7, warmup: int = 2) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs (robust on a busy machine)."""
    return min(interleaved({"fn": fn}, repeats, warmup).times["fn"])
