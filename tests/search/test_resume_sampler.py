"""Resuming a study continues its sampler: new points, not the first trials' parameters again, and still
reproducible (same seed and history give the same next parameters) for random, TPE and NSGA-II."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.search import MixedPrecisionSpace, Search, TensorTask
from fxforge.search.runner import trial_result

SPACE = MixedPrecisionSpace({"integer": {"width": [2, 3, 4, 5, 6, 8], "frac_width": [1, 2]}},
                            roles=("weight", "data_in"), per="layer")


@pytest.fixture(scope="module")
def setup() -> tuple[ForgeGraph, TensorTask]:
    return tiny_search_setup(64)


def _run(setup: tuple[ForgeGraph, TensorTask], run_dir: Path, storage: str | None, sampler: str,
         n_trials: int, resume: bool) -> list[dict]:
    mg, task = setup
    result = Search(SPACE, ["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=n_trials, sampler=sampler,
                    storage=storage, run_dir=run_dir, resume=resume, progress=False, seed=0).run()
    trials = result.study.trials
    assert len(trials) == n_trials
    return trials


@pytest.mark.parametrize(("sampler", "kind"), [("random", "journal"), ("random", "sqlite"), ("tpe", "journal"),
                                               ("nsga2", "sqlite")])
def test_resumed_study_samples_new_points_reproducibly(setup, tmp_path: Path, sampler: str, kind: str) -> None:
    def run_twice(run_dir: Path) -> list[dict]:
        run_dir.mkdir()
        storage = f"sqlite:///{run_dir / 'study.db'}" if kind == "sqlite" else None
        _run(setup, run_dir, storage, sampler, 3, resume=False)
        return _run(setup, run_dir, storage, sampler, 6, resume=True)

    trials = run_twice(tmp_path / "a")
    first, resumed = [t.params for t in trials[:3]], [t.params for t in trials[3:]]
    assert resumed != first  # the bug: the re-seeded sampler drew trials 0-2's parameters again
    assert not [t.number for t in trials[3:] if "cached_from" in trial_result(t)]  # each a new point, evaluated
    again = run_twice(tmp_path / "b")  # same seed, same history: same next parameters
    assert [t.params for t in again] == [t.params for t in trials]


def test_workers_opening_a_study_together_sample_different_points(setup, tmp_path: Path) -> None:
    """Two workers that open the study at the same trial count (both at its start, as search_joint's --workers
    launch them) drew the same points from the same seed: each configuration was evaluated twice."""
    mg, task = setup

    def first_params(worker: int | None, run_dir: Path) -> list[dict]:
        search = Search(SPACE, ["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=3, sampler="tpe",
                        run_dir=run_dir, progress=False, seed=0, worker=worker)
        study = search.open_study()  # what each worker process does first: same study, same (empty) history
        drawn = []
        for _ in range(3):
            trial = study.ask()
            search._bound.suggest(trial)
            drawn.append(dict(trial.params))
        return drawn

    a = first_params(0, tmp_path / "w0")
    b = first_params(1, tmp_path / "w1")
    assert a != b
    assert first_params(0, tmp_path / "w0-again") == a  # a worker's index gives a reproducible seed
    with pytest.raises(Exception, match="worker must be None or an integer >= 0"):
        Search(SPACE, ["accuracy"], base=mg, task=task, worker=-1)
