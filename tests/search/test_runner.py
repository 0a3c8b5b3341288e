"""The search runner on tiny models: fresh copies per trial, the plan cache, resume, clashes, results."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import optuna
import pytest
import torch
from conftest import TinyMLP

from fxforge import ForgeGraph
from fxforge.search import Constraint, MixedPrecisionSpace, Search, SearchError, TensorTask
from fxforge.search.runner import PLAN_ATTR, trial_plan_key, trial_result


@pytest.fixture
def setup() -> tuple[ForgeGraph, TensorTask]:
    torch.manual_seed(0)
    net = TinyMLP().eval()
    x = torch.randn(96, 8)
    labels = net(x).argmax(-1)  # the float model is exact on its own labels: quantization can only lose
    mg = ForgeGraph(net, (x[:4],))
    return mg, TensorTask({"x": x}, labels, batch_size=32)


SPACE = MixedPrecisionSpace({"integer": {"width": [2, 3, 4, 8], "frac_width": [1, 2]}}, roles=("weight", "data_in"),
                            per="layer")


def _search(mg: ForgeGraph, task: TensorTask, tmp: Path, **kw: object) -> Search:
    args = dict(space=SPACE, objectives=["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=6,
                sampler="random", run_dir=tmp, progress=False)
    args.update(kw)
    return Search(**args)  # type: ignore[arg-type]


def test_trials_start_from_fresh_copies_and_results_rebuild(setup, tmp_path: Path) -> None:
    mg, task = setup
    before = {k: v.clone() for k, v in mg.model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated Optuna API (constraints_func)
        result = _search(mg, task, tmp_path, constraints=[Constraint("accuracy", max_drop=0.5)],
                         sampler="nsga2").run()
    assert not any(type(m).__name__.startswith("Quantized") for m in mg.model.modules())  # base untouched
    assert all(torch.equal(before[k], v) for k, v in mg.model.state_dict().items())
    assert mg.history == []
    done = result.completed()
    assert len(done) == 6 and result.baseline["accuracy"] == 1.0 and result.baseline["avg_weight_bits"] == 32.0
    for t in done:  # every trial quantized both layers with its own widths, on a fresh copy
        bits = trial_result(t)["values"]["avg_weight_bits"]
        assert bits < 32.0
        assert list(t.constraints.values()) == trial_result(t)["constraints"]  # what the sampler sees
    front = result.front()
    assert front and all(r["feasible"] for r in result.rows())
    rebuilt = result.rebuild(front[0])
    assert task.accuracy(rebuilt) == pytest.approx(front[0].values[0])
    paths = result.export(tmp_path / "pareto", front[:1])
    assert ForgeGraph.from_checkpoint(paths[0]).history[-1].name == "quantize_transform_pass"
    assert "trial" in result.table() and (tmp_path / "f.csv").exists() is False
    result.to_csv(tmp_path / "f.csv")
    result.to_json(tmp_path / "f.json")
    assert (tmp_path / "f.csv").read_text().count("\n") == len(front) + 1


def test_identical_plans_are_evaluated_once(setup, tmp_path: Path) -> None:
    mg, task = setup
    space = MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [2, 4]}}, roles=("weight",))
    result = _search(mg, task, tmp_path, space=space, n_trials=5).run()
    cached = [t for t in result.completed() if "cached_from" in trial_result(t)]
    keys = {trial_plan_key(t) for t in result.completed()}
    assert len(keys) <= 2 and len(cached) == 5 - len(keys)
    for t in cached:
        assert t.values == result.study.trials[trial_result(t)["cached_from"]].values


def test_resume_keeps_finished_trials_once_and_clashes_are_refused(setup, tmp_path: Path) -> None:
    mg, task = setup
    first = _search(mg, task, tmp_path, n_trials=3).run()
    numbers = [t.number for t in first.completed()]
    with pytest.raises(SearchError, match="already exists .* pass resume=True"):
        _search(mg, task, tmp_path, n_trials=5).run()
    other = MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [4]}})
    with pytest.raises(SearchError, match="exists with a different search space"):
        _search(mg, task, tmp_path, space=other, resume=True).run()
    resumed = _search(mg, task, tmp_path, n_trials=5, resume=True).run()
    done = resumed.completed()
    assert len(done) == 5 and [t.number for t in done][:3] == numbers


def test_bad_configuration_is_refused_before_any_trial(setup, tmp_path: Path) -> None:
    mg, task = setup
    with pytest.raises(SearchError, match="unknown sampler 'annealing'"):
        _search(mg, task, tmp_path, sampler="annealing")
    with pytest.raises(SearchError, match="unknown objective 'speed'"):
        _search(mg, task, tmp_path, objectives=["speed"])
    with pytest.raises(SearchError, match="constraint on 'latency_ms', which is not an objective"):
        _search(mg, task, tmp_path, constraints=[Constraint("latency_ms", max_value=1.0)])
    with pytest.raises(SearchError, match="starts every trial from a base graph"):
        _search(None, task, tmp_path)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_single_objective_with_tpe_and_plots(setup, tmp_path: Path) -> None:
    mg, task = setup
    result = _search(mg, task, tmp_path, objectives=["avg_weight_bits"], sampler="tpe", n_trials=4).run()
    assert result.study.best_value < 32
    files = result.plots(tmp_path / "plots")
    names = {p.name for p in files}
    assert "optimization_history.html" in names and "history_avg_weight_bits.png" in names
    html = (tmp_path / "plots" / "optimization_history.html").read_text()
    assert "<script src=\"http" not in html and len(html) > 100_000  # plotly inlined: opens offline
    assert optuna.trial.TrialState.COMPLETE in {t.state for t in result.study.trials}


def test_enqueued_configurations_run_first_once_and_are_checked(setup, tmp_path: Path) -> None:
    mg, task = setup
    space = MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 6]}}, roles=("weight",))
    hand = {"linear:integer:weight_width": 8, "linear:integer:weight_frac_width": 6}
    first = _search(mg, task, tmp_path, space=space, n_trials=2, enqueue=[hand]).run()
    assert first.study.trials[0].params == hand
    resumed = _search(mg, task, tmp_path, space=space, n_trials=4, enqueue=[hand], resume=True).run()
    assert len(resumed.completed()) == 4  # on resume the hand-picked trial is not enqueued (or evaluated) again
    assert [t.number for t in resumed.study.trials if t.params == hand and "cached_from" not in trial_result(t)] == [0]
    with pytest.raises(SearchError, match=r"samples no parameter\(s\) \['linear:integer:bias_width'\]"):
        _search(mg, task, tmp_path, space=space, enqueue=[{**hand, "linear:integer:bias_width": 8}])
    with pytest.raises(SearchError, match="does not fit the space"):
        _search(mg, task, tmp_path, space=space, enqueue=[{**hand, "linear:integer:weight_width": 6}])
    with pytest.raises(SearchError, match="does not fit the space"):
        _search(mg, task, tmp_path, space=space, enqueue=[{"linear:integer:weight_width": 8}])
    with pytest.raises(SearchError, match=r"samples no parameter\(s\) \['linear:integer:weight_frac_width'\]"):
        # 4 bits admit only the fraction width 2 of the choices: that parameter is not sampled for them
        _search(mg, task, tmp_path, space=space, enqueue=[{"linear:integer:weight_width": 4,
                                                           "linear:integer:weight_frac_width": 6}])


def test_taylor_pruning_scores_with_the_tasks_calibration_batches(setup, tmp_path: Path) -> None:
    """A PruningSpace with method 'taylor' gets the task's calibration batches (held apart from the
    evaluation data) in every trial and in rebuilds; the stored plan stays plain JSON; no calibration
    data is one clear SearchError."""
    from fxforge.passes.prune import prune_transform_pass
    from fxforge.search import PruningSpace

    mg, task = setup
    space = PruningSpace([0.5], method="taylor", granularity="row")
    with pytest.raises(SearchError, match="calibration=\\(inputs, labels\\)"):
        Search(space, ["accuracy"], base=mg, task=task, n_trials=1, run_dir=tmp_path / "none", progress=False).run()
    torch.manual_seed(1)
    xc = torch.randn(64, 8)
    calibrated = TensorTask({"x": task.eval_batches()[0][0]["x"]}, task.eval_batches()[0][1], batch_size=32,
                            calibration=({"x": xc}, mg.model(xc).argmax(-1)))
    result = Search(space, ["accuracy", "avg_weight_bits"], base=mg, task=calibrated, n_trials=1,
                    run_dir=tmp_path / "ok", progress=False).run()
    trial = result.completed()[0]
    steps = trial.user_attrs[PLAN_ATTR]["steps"]  # the stored plan: plain JSON, no batches or loss in it
    assert [set(args) for _, args in steps] == [{"weight", "targets"}] * len(steps) and steps
    json.dumps(trial.user_attrs[PLAN_ATTR])
    data, loss_fn = calibrated.calibration(mg.model)
    direct, _ = prune_transform_pass(mg.copy(), {"weight": {"sparsity": 0.5, "method": "taylor", "granularity": "row"},
                                                 "data": data, "num_batches": len(data), "loss_fn": loss_fn})
    rebuilt = result.rebuild(trial)
    for name in ("fc1", "fc2"):
        assert torch.equal(rebuilt.model.get_submodule(name).weight_mask, direct.model.get_submodule(name).weight_mask)
    l1, _ = prune_transform_pass(mg.copy(), {"weight": {"sparsity": 0.5, "method": "l1", "granularity": "row"}})
    assert not torch.equal(l1.model.fc1.weight_mask, direct.model.fc1.weight_mask)
