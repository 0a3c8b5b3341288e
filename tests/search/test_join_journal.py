"""A second process joining a journal study that another live process runs: its open must not fail the other's
RUNNING trial (a resume after a crash still does: the journal has no heartbeat to tell the two apart)."""

from __future__ import annotations

from pathlib import Path

import optuna
from conftest import tiny_search_setup

from fxforge.search import MixedPrecisionSpace, Search

RUNNING, FAIL = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL


def _search(tmp_path: Path, **kw: object) -> Search:
    base, task = tiny_search_setup(64)
    space = MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 4]}}, roles=("weight",))
    return Search(space, ["accuracy"], base=base, task=task, n_trials=2, sampler="random", run_dir=tmp_path,
                  study_name="j", progress=False, **kw)  # type: ignore[arg-type]


def test_joining_keeps_the_live_trial_and_a_resume_fails_it(tmp_path: Path) -> None:
    study = _search(tmp_path).open_study()
    live = study.ask()  # another worker's trial, in progress
    _search(tmp_path, resume=True, fail_stale=False).run()
    states = {t.number: t.state for t in _search(tmp_path, resume=True, fail_stale=False).open_study().trials}
    assert states[live.number] == RUNNING and list(states.values()).count(optuna.trial.TrialState.COMPLETE) == 2
    resumed = _search(tmp_path, resume=True).open_study()  # a plain resume: what is RUNNING was left by a crash
    assert resumed.trials[live.number].state == FAIL
