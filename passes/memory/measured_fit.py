"""Fit a checkpoint plan on the allocator's measured peak instead of the planner's estimate.

The planner's memory model (checkpoint_plan.plan_of) prices a plan from per-node saved bytes; it is off by up
to ~15 % where storages are shared across a segment's edge (a view a later node saves, a kept result that is
also a region's output) or where the gradients in flight are smaller than its transient. A plan picked on the
estimate then either misses the budget or saves more than it needs, and pays recomputation for it (the zoo GPT
at T = 1024: regions keeping their attentions' results estimated 58.3 MB measure 50.6).

So, when asked, the pass searches on measurements: it plans for an *estimate* budget x, rewrites a copy of the
graph with that plan and measures one training step's allocator peak; then bisects x (in log-space) for the
largest one whose plan still measures within the real budget. Plans repeat across x, so each distinct plan is
measured once; of all plans measured within the budget the one with the least recompute wins. The plans
themselves come from the planner, so their peaks jump (MiniLM 8x128 for 63.5 MB: 53.3 MB measured, the next
one 71.3): the fit chooses among them, it does not make new ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .checkpoint_plan import GraphCosts, Plan, plan_checkpoints

__all__ = ["MeasuredFit", "fit_measured"]


@dataclass(frozen=True)
class MeasuredFit:
    """The chosen plan (None: none measured within the budget), its measured peak, the smallest estimated peak
    any plan reaches, the smallest measured peak seen, every trial as (estimate budget, plan peak estimate,
    measured peak) in bytes, and how many distinct plans were measured."""

    plan: Plan | None
    measured: int | None
    least_estimate: int
    least_measured: int | None
    trials: tuple[tuple[int, int, int], ...]
    measured_plans: int  # distinct plans measured (a plan recurring across estimate budgets is measured once)


def fit_measured(costs: GraphCosts, budget: int, measure: Callable[[Plan], int], rounds: int = 6) -> MeasuredFit:
    """Bisect the planner's budget so that the chosen plan's ``measure``d peak is within ``budget`` (module
    docstring); ``rounds`` bisection steps after the first plan and the bracketing one."""
    seen: dict[tuple[tuple[int, int], ...], int] = {}
    trials: list[tuple[int, int, int]] = []
    fits: list[tuple[Plan, int]] = []

    def trial(x: int) -> tuple[Plan | None, int]:
        plan, least = plan_checkpoints(costs, x)
        if plan is None:
            return None, least
        if plan.segments not in seen:
            seen[plan.segments] = measure(plan)
            if seen[plan.segments] <= budget:
                fits.append((plan, seen[plan.segments]))
        trials.append((x, plan.peak, seen[plan.segments]))
        return plan, least

    plan, least = trial(budget)
    if plan is not None and seen[plan.segments] <= budget:  # fits: look for a cheaper plan at larger estimates
        lo, hi = budget, max(costs.baseline_peak, budget + 1)
    else:  # misses, or no plan on the estimate: from the least estimate up to where it missed (or the top)
        first, _ = trial(least)
        if first is None or seen[first.segments] > budget:
            return MeasuredFit(None, None, least, min(seen.values(), default=None), tuple(trials), len(seen))
        lo, hi = least, budget if plan is not None else max(costs.baseline_peak, least + 1)
    for _ in range(rounds):
        if hi <= lo + 1:
            break
        mid = int(math.exp((math.log(lo) + math.log(hi)) / 2))
        found, _ = trial(mid)
        if found is not None and seen[found.segments] <= budget:
            lo = mid
        else:
            hi = mid
    best, peak = min(fits, key=lambda f: (f[0].cost, f[1]))
    return MeasuredFit(best, peak, least, min(seen.values()), tuple(trials), len(seen))
