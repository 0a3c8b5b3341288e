"""Samplers and pruners by name, and the seed a study's sampler gets each time the study is opened.

A study opened again (resumed, or joined) with the same base seed must not replay the sequence its first
run drew: the sampler's seed is derived from the base seed and the number of trials the study already
holds, so a resumed study samples new points, and the same seed with the same history still gives the
same next parameters (a fresh study keeps the base seed itself). Processes working on one study at the
same time pass their worker index: two workers that open the study at the same trial count would otherwise
get the same seed and, from the same history, sample the same points (each evaluated twice).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import optuna

from .errors import SearchError

if TYPE_CHECKING:
    from .fidelity import Fidelity

__all__ = ["PRUNERS", "SAMPLERS", "make_pruner", "make_sampler", "study_seed"]

SAMPLERS: tuple[str, ...] = ("gp", "grid", "nsga2", "random", "tpe")
PRUNERS: tuple[str, ...] = ("hyperband", "median", "none", "successive_halving")
MAX_SEED = 2**32 - 1  # numpy's RandomState, which Optuna's samplers seed, takes 0 .. 2**32 - 1


def study_seed(seed: int | None, n_existing: int, worker: int | None = None) -> int | None:
    """The sampler seed for a study that already holds ``n_existing`` trials (any state), opened by worker
    ``worker`` (None: the only process): ``seed`` for a new study opened by its only process, otherwise a hash
    of all three (None stays None: unseeded)."""
    if seed is None or (n_existing == 0 and worker is None):
        return seed
    tag = "" if worker is None else f":worker{worker}"
    digest = hashlib.sha256(f"fxforge-sampler:{seed}:{n_existing}{tag}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_sampler(name: str, seed: int | None) -> optuna.samplers.BaseSampler:
    """A sampler by name; constraints reach it through each trial's ``set_constraint`` (Optuna 5)."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.BruteForceSampler(seed=seed)
    raise SearchError(f"unknown sampler {name!r}; choose from {list(SAMPLERS)}")


def make_pruner(name: str | None, fidelity: Fidelity | None = None) -> optuna.pruners.BasePruner:
    """A pruner by name (None or "none": no pruning). With a fidelity schedule, successive halving and
    Hyperband get their resources from it: the first rung's budget as the minimum, the last's as
    Hyperband's maximum, and the schedule's geometric factor as the reduction factor, so Optuna's rungs
    are the schedule's (a schedule that is not geometric is refused, naming one that is)."""
    if name in (None, "none"):
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if name == "successive_halving":
        if fidelity is None:
            return optuna.pruners.SuccessiveHalvingPruner()
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=fidelity.budget(0),
                                                      reduction_factor=fidelity.reduction_factor)
    if name == "hyperband":
        if fidelity is None:
            return optuna.pruners.HyperbandPruner()
        return optuna.pruners.HyperbandPruner(min_resource=fidelity.budget(0), max_resource=fidelity.budget(-1),
                                              reduction_factor=fidelity.reduction_factor)
    raise SearchError(f"unknown pruner {name!r}; choose from {list(PRUNERS)}")
