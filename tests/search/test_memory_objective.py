"""The peak_train_mb objective (issue 31 item 5): the allocator's peak over one training step of each trial's
graph, recorded per trial, usable in constraints, and accepted by name in a search config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_search_setup

from fxforge.search import Constraint, MixedPrecisionSpace, Search, SearchError, search_from_config
from fxforge.search.objectives import OBJECTIVES, peak_train_mb
from fxforge.search.runner import trial_result

SPACE = MixedPrecisionSpace({"integer": {"width": [2, 4, 8], "frac_width": [1, 2]}}, roles=("weight", "data_in"))


def _search(tmp_path: Path, base: Any, task: Any, **kw: Any) -> Any:
    return Search(space=SPACE, objectives=["accuracy", "peak_train_mb"], base=base, task=task, n_trials=3,
                  sampler="random", run_dir=tmp_path, progress=False, **kw).run()


def test_each_trial_records_its_measured_training_peak(tmp_path: Path) -> None:
    base, task = tiny_search_setup(64)
    assert OBJECTIVES["peak_train_mb"].direction == "minimize"
    result = _search(tmp_path, base, task)
    trials = result.completed()
    assert len(trials) == 3
    for t in trials:
        value, notes = t.values[1], trial_result(t)["notes"]["peak_train_mb"]
        assert value > 0 and notes["bytes"] == round(value * 2**20) and notes["batch"] == "eval batch 0"
        # measured on the trial's own graph: its rebuilt graph measures the same
        assert peak_train_mb(result.rebuild(t), task).value == value
    # simulated quantizers keep more for backward than the float base graph does
    assert min(t.values[1] for t in trials) > result.baseline["peak_train_mb"] > 0


def test_measuring_leaves_the_graph_mode_grads_and_rng_alone() -> None:
    base, task = tiny_search_setup(64)
    model = base.model
    model.eval()
    grad = torch.ones_like(model.fc1.weight)
    model.fc1.weight.grad = grad
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    got = peak_train_mb(base, task)
    assert got.value > 0 and not model.training and model.fc1.weight.grad is grad
    assert model.fc2.weight.grad is None
    assert torch.equal(torch.rand(4), expected)
    assert peak_train_mb(base, None).notes["batch"] == "example inputs"


def test_a_constraint_on_it_marks_trials_over_the_limit_infeasible(tmp_path: Path) -> None:
    """The limit is the float graph's own peak: every quantized trial measures above it."""
    base, task = tiny_search_setup(64)
    limit = peak_train_mb(base, task).value
    over = _search(tmp_path / "tight", base, task, constraints=[Constraint("peak_train_mb", max_value=limit)])
    rows = over.rows(over.completed())
    for t, row in zip(over.completed(), rows):
        violation = trial_result(t)["constraints"][0]
        assert violation == pytest.approx(t.values[1] - limit) and violation > 0
        assert row["feasible"] is False
    roomy = _search(tmp_path / "roomy", base, task, constraints=[Constraint("peak_train_mb", max_value=100 * limit)])
    assert all(r["feasible"] is True for r in roomy.rows(roomy.completed()))


def _config(objective: str, checkpoint: Path) -> dict[str, Any]:
    """A TinyMLP checkpoint, one 8-bit trial, no task: the step runs on the graph's example inputs."""
    return {"search": {"study_name": "mem", "n_trials": 1, "sampler": "random", "objectives": [objective],
                       "run_dir": "run"},
            "model": {"checkpoint": str(checkpoint)},
            "space": {"kind": "precision", "formats": {"integer": {"width": [8], "frac_width": [4]}}},
            "constraints": [{"objective": objective, "max_value": 1000.0}]}


def test_config_accepts_the_name_and_refuses_a_misspelling(tmp_path: Path) -> None:
    checkpoint = tiny_search_setup(8)[0].export(tmp_path / "mlp")
    result = search_from_config(_config("peak_train_mb", checkpoint), output_root=tmp_path).run()
    (trial,) = result.completed()
    assert trial.values[0] > 0 and trial_result(trial)["notes"]["peak_train_mb"]["batch"] == "example inputs"
    assert trial_result(trial)["constraints"][0] < 0  # well under 1000 MB
    with pytest.raises(SearchError, match=r"unknown objective 'peak_trian_mb' \(did you mean 'peak_train_mb'\?\);"
                                          r" built-in: \[.*'peak_train_mb'"):
        # refused before the model is loaded (this checkpoint does not exist) or anything else is built
        search_from_config(_config("peak_trian_mb", tmp_path / "missing"), output_root=tmp_path / "other")
