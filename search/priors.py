"""The sensitivity prior: spaces that seed and shape the sampler from one sensitivity measurement.

With ``prior="sensitivity"`` a :class:`MixedPrecisionSpace` or :class:`PruningSpace` has the study measure
``sensitivity_analysis_pass`` once on the base graph and the task's calibration batches, stored in the study
(``SensitivityInfo.to_json``: resumes and other workers read it back instead of measuring again). From it:

- each layer's widths (each group's sparsities) are restricted to those whose estimated loss increase stays
  within a bound (``loss_bound``, default half the baseline loss); the widest width (the smallest sparsity)
  always stays. Every worker derives the same restriction from the stored measurement, so an Optuna
  parameter keeps the same choices in every trial;
- allocations minimising the total estimated loss increase are enqueued at several budgets (average weight
  bits :data:`BIT_BUDGETS`, overall sparsity :data:`SPARSITY_BUDGETS`): a greedy multiple-choice knapsack.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..passes.analysis.sensitivity_types import SensitivityInfo
from .errors import SearchError

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph
    from .space import SearchSpace
    from .task import Task

__all__ = ["BIT_BUDGETS", "PRIORS", "SENSITIVITY_ATTR", "SPARSITY_BUDGETS", "allocate", "allowed_choices",
           "apply_prior", "check_prior", "check_prior_args", "pick_params", "sensitivity_bound"]

PRIORS = ("sensitivity",)
SENSITIVITY_ATTR = "fxforge_sensitivity"  # the study's user attribute holding SensitivityInfo.to_json()
SENSITIVITY_PASS = "sensitivity_analysis_pass"
METHOD = "loss"  # measured: the calibration loss with each layer alone quantized (the one method whose ranking
# reached Spearman >= 0.7 against measured accuracy drops, tests/passes/test_sensitivity_ranking.py)
BIT_BUDGETS = (3.0, 4.0, 5.0, 6.0)  # average weight bits (weighted by each layer's parameters)
SPARSITY_BUDGETS = (0.4, 0.3, 0.2, 0.1)  # overall sparsity, most aggressive first like BIT_BUDGETS
DEFAULT_BOUND = 0.5  # a choice is kept when its loss increase is at most this fraction of the baseline loss
Option = tuple[Any, float, float]  # (choice, cost, estimated loss increase)


def check_prior_args(what: str, prior: Any, loss_bound: Any) -> None:
    """Refuse an unknown prior, or a loss bound that is not a positive finite number or comes without a prior."""
    if prior is not None and prior not in PRIORS:
        raise SearchError(f"{what} space: unknown prior {prior!r}; choose from {list(PRIORS)} (or leave it unset)")
    if loss_bound is not None:
        if prior is None:
            raise SearchError(f"{what} space: loss_bound only applies with prior='sensitivity'")
        if isinstance(loss_bound, bool) or not isinstance(loss_bound, int | float) or not math.isfinite(loss_bound) \
                or loss_bound <= 0:
            raise SearchError(f"{what} space: loss_bound must be a positive number, got {loss_bound!r}")


def sensitivity_bound(info: SensitivityInfo, loss_bound: float | None) -> float:
    """The loss increase a choice may cost: ``loss_bound`` if given, else DEFAULT_BOUND x the baseline loss."""
    return float(loss_bound) if loss_bound is not None else DEFAULT_BOUND * max(info.baseline_loss, 0.0)


def allowed_choices(losses: Mapping[Any, float], keep: Any, bound: float) -> tuple[Any, ...]:
    """The choices (in the given order) whose loss increase is within ``bound``, and ``keep`` always."""
    return tuple(c for c, loss in losses.items() if c == keep or loss <= bound)


def allocate(options: Sequence[Sequence[Option]], capacity: float) -> list[Any] | None:
    """One choice per item minimising the summed loss with the summed cost within ``capacity`` (None when
    even the cheapest choices exceed it): start from each item's cheapest choice, then repeatedly take the
    change with the largest loss saved per unit of extra cost that still fits (greedy multiple-choice knapsack)."""
    pick = [_cheapest(o) for o in options]
    slack = capacity * (1 + 1e-9) + 1e-9
    used = sum(o[p][1] for o, p in zip(options, pick))
    if used > slack:
        return None
    while True:
        best: tuple[float, int, int, float] | None = None
        for i, o in enumerate(options):
            _, c0, l0 = o[pick[i]]
            for j, (_, c, loss) in enumerate(o):
                saved, extra = l0 - loss, c - c0
                if saved <= 0 or used + extra > slack:
                    continue
                rate = saved / extra if extra > 0 else math.inf
                if best is None or rate > best[0]:
                    best = (rate, i, j, extra)
        if best is None:
            return [o[p][0] for o, p in zip(options, pick)]
        _, i, j, extra = best
        pick[i], used = j, used + extra


def _cheapest(options: Sequence[Option]) -> int:
    """The index of the cheapest option (the least loss among equally cheap ones)."""
    return min(range(len(options)), key=lambda j: (options[j][1], options[j][2]))


def allocations(options: Sequence[Sequence[Option]], capacities: Sequence[float]) -> list[list[Any]]:
    """:func:`allocate` at each capacity, distinct ones only; the cheapest allocation if none fits."""
    out: list[list[Any]] = []
    for capacity in capacities:
        chosen = allocate(options, capacity)
        if chosen is not None and chosen not in out:
            out.append(chosen)
    if not out:
        cheapest = allocate(options, sum(min(c for _, c, _ in o) for o in options))
        out.append(cheapest if cheapest is not None else [o[0][0] for o in options])
    return out


class _Chooser:
    """A stand-in trial answering each categorical with ``rule(name, choices)``, recording what it answered:
    replaying a space's own ``suggest`` gives exactly the space's parameter names and choices."""

    def __init__(self, rule: Callable[[str, Sequence[Any]], Any]) -> None:
        self.rule = rule
        self.params: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        value = self.rule(name, choices)
        if value not in choices:
            raise SearchError(f"sensitivity prior: {value!r} is not a choice of {name!r} ({list(choices)})")
        self.params[name] = value
        return value


def pick_params(space: SearchSpace, rule: Callable[[str, Sequence[Any]], Any]) -> dict[str, Any]:
    """The parameters ``space.suggest`` samples when every categorical is answered by ``rule``."""
    import optuna

    chooser = _Chooser(rule)
    try:
        space.suggest(chooser)  # type: ignore[arg-type]  # duck-typed: spaces only call suggest_categorical
    except optuna.TrialPruned as exc:
        raise SearchError(f"sensitivity prior: an allocation is an invalid combination ({exc})") from None
    return chooser.params


def checked_params(space: SearchSpace, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` if each names a parameter the space samples and is one of its choices (parameters not given
    are left to the sampler); SearchError otherwise."""
    def given(name: str, choices: Sequence[Any]) -> Any:
        return params[name] if name in params else choices[0]

    seen = pick_params(space, given)
    unused = sorted(set(params) - set(seen))
    if unused:
        raise SearchError(f"sensitivity prior: the space samples no parameter(s) {unused}")
    return dict(params)


# -- the study ---------------------------------------------------------------------------------------------
def prior_spaces(space: SearchSpace) -> list[Any]:
    """The spaces (the space itself, or a joint space's members) that have a prior."""
    members = getattr(space, "spaces", (space,))
    return [s for s in members if getattr(s, "prior", None) is not None]


def check_prior(space: SearchSpace, task: Task | None) -> None:
    """Before any trial: a space with a prior needs a task with calibration batches to measure on."""
    if not prior_spaces(space):
        return
    if task is None:
        raise SearchError("prior='sensitivity' measures sensitivity on the task's calibration batches: pass a task "
                          "with calibration data (e.g. TensorTask(..., calibration=(inputs, labels)))")
    if not list(task.calibration_batches()):  # a task without calibration data raises SearchError itself
        raise SearchError(f"prior='sensitivity': {type(task).__name__}'s calibration data is empty")


def measure(space: SearchSpace, base: ForgeGraph, task: Task) -> SensitivityInfo:
    """Run the sensitivity pass on a copy of ``base`` with what every prior space asks to be measured."""
    from ..passes.base import PASSES

    sensitivity = PASSES.get(SENSITIVITY_PASS)
    if sensitivity is None:
        raise SearchError(f"prior='sensitivity' needs {SENSITIVITY_PASS}, which this build does not register")
    args: dict[str, Any] = {"method": METHOD, "widths": (8,), "prune_ratios": ()}  # what no prior space asks: least
    for s in prior_spaces(space):
        args.update(s.sensitivity_request())
    # labels inside each batch: the pass's default cross-entropy reads them from the batch (the pass splits
    # batches into samples for the Fisher, so a loss_fn keyed by the batch object would not find them)
    data = [{**inputs, "labels": labels} for inputs, labels in task.calibration_batches()]
    _, info = sensitivity(base.copy(), {**args, "data": data})
    if not isinstance(info, SensitivityInfo):
        raise SearchError(f"{SENSITIVITY_PASS} returned {type(info).__name__}, not SensitivityInfo")
    return info


def study_sensitivity(study: optuna.Study, space: SearchSpace, base: ForgeGraph | None,
                      task: Task | None) -> SensitivityInfo:
    """The study's stored sensitivity (checked: a study's attributes are hostile input), else measured once
    and stored for resumes and other workers."""
    stored = study.user_attrs.get(SENSITIVITY_ATTR)
    if stored is not None:
        try:
            return SensitivityInfo.from_json(stored)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise SearchError(f"study {study.study_name!r}: its stored sensitivity ({SENSITIVITY_ATTR}) is invalid "
                              f"({exc}); start a new study") from None
    if base is None or task is None:
        raise SearchError("prior='sensitivity' needs the base graph and a task with calibration data")
    study.set_user_attr(SENSITIVITY_ATTR, measure(space, base, task).to_json())
    # what the study holds now, as every resume reads it (a worker that measured at the same time wrote last)
    return SensitivityInfo.from_json(study.user_attrs[SENSITIVITY_ATTR])


def apply_prior(space: SearchSpace, study: optuna.Study, base: ForgeGraph | None,
                task: Task | None) -> tuple[SearchSpace, list[dict[str, Any]]]:
    """The bound space shaped by the study's sensitivity and the allocations to enqueue first (checked
    against the shaped space); ``(space, [])`` when no member has a prior."""
    if not prior_spaces(space):
        return space, []
    info = study_sensitivity(study, space, base, task)
    members = getattr(space, "spaces", None)
    if members is not None:
        shaped = type(space)(*(s.with_sensitivity(info, base) if getattr(s, "prior", None) else s for s in members))
    else:
        shaped = space.with_sensitivity(info, base)  # type: ignore[attr-defined]
    per_space = [s.prior_allocations() for s in prior_spaces(shaped)]
    longest = max(len(a) for a in per_space)
    seeded = []
    for i in range(longest):  # i-th allocation of each prior space together (the shorter lists repeat their last)
        params: dict[str, Any] = {}
        for allocs in per_space:
            params.update(allocs[min(i, len(allocs) - 1)])
        params = checked_params(shaped, params)
        if params not in seeded:
            seeded.append(params)
    return shaped, seeded
