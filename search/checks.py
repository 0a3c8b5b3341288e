"""A search's run settings checked before anything is created: each bad value is one SearchError naming
the field, instead of numpy's error inside trial 0 (a seed out of range) or a run that quietly did
something else (a negative timeout, an empty study name)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import SearchError
from .objectives import Objective
from .samplers import MAX_SEED

__all__ = ["check_run_settings"]


def check_run_settings(n_trials: Any, seed: Any, timeout: Any, study_name: Any, objectives: Sequence[Objective],
                       task: Any) -> None:
    """Refuse a bad trial count, seed, timeout or study name, and objectives measured on a task without one."""
    if type(n_trials) is not int or n_trials < 1:
        raise SearchError(f"n_trials must be an integer >= 1, got {n_trials!r}")
    if seed is not None and (type(seed) is not int or not 0 <= seed <= MAX_SEED):
        raise SearchError(f"seed must be None or an integer in [0, 2**32 - 1], got {seed!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0):
        raise SearchError(f"timeout must be None or a positive number of seconds, got {timeout!r}")
    if not isinstance(study_name, str) or not study_name.strip():
        raise SearchError(f"study_name must be a non-empty string, got {study_name!r}")
    if task is None:
        needing = [o.name for o in objectives if o.needs_task]
        if needing:
            raise SearchError(f"objective {needing[0]!r} needs a task (evaluation data): pass task=")
