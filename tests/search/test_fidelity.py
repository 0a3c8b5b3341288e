"""Multi-fidelity trials: each trial trains and is measured at growing budgets (fine-tune steps, eval samples),
reports every rung, and Optuna's successive-halving / Hyperband pruner stops a bad configuration early."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyMLP

from fxforge import ForgeGraph
from fxforge.search import PruningSpace, Search, SearchError, TensorTask, load_config, search_from_config
from fxforge.search.fidelity import Fidelity, FidelityTask
from fxforge.search.runner import trial_result

COMPLETE, PRUNED = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
TRAINED = Fidelity(steps=(5, 15, 45), eval_samples=(30, 90, 270))
# sparsity 0.5 is good but hurt, 0.99 deliberately bad (a dead model), 0.0 the best: in this order Optuna's
# asynchronous successive halving promotes the first trial (alone at its rung) and the best so far
ORDER = [{"sparsity:linear": s} for s in (0.5, 0.99, 0.0)]


class _CountingTask(TensorTask):
    """A TensorTask that records the rung steps its training reached and how many trainings ran to the end."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.reached: list[int] = []
        self.finished = 0

    def train(self, graph: Any, trial: Any, steps: int | None = None, checkpoints: Any = (),
              on_checkpoint: Any = None) -> None:
        def reach(step: int) -> None:
            self.reached.append(step)
            on_checkpoint(step)

        super().train(graph, trial, steps, checkpoints, reach if on_checkpoint else None)
        self.finished += 1


@pytest.fixture(scope="module")
def setup() -> tuple[ForgeGraph, _CountingTask]:
    """TinyMLP trained to ~96% on a learnable rule (the class is the largest of the first three inputs), 270
    held-out rows, 600 training rows for the trials' fine-tune."""
    torch.manual_seed(0)
    net = TinyMLP()
    x = torch.randn(870, 8)
    y = x[:, :3].argmax(-1)
    for _ in range(300):  # plain SGD by hand: torch.optim's first step imports torch._dynamo (seconds)
        net.zero_grad()
        F.cross_entropy(net(x[270:]), y[270:]).backward()
        with torch.no_grad():
            for p in net.parameters():
                p.sub_(p.grad, alpha=0.5)
    net.eval()
    assert (net(x[:270]).argmax(-1) == y[:270]).float().mean() > 0.9
    task = _CountingTask({"x": x[:270]}, y[:270], batch_size=50, training=({"x": x[270:]}, y[270:]),
                         learning_rate=0.05)
    return ForgeGraph(net, (x[:4],)), task


def _search(setup: tuple[ForgeGraph, TensorTask], tmp_path: Path, fidelity: Any, pruner: str | None = None,
            finetune: bool = True, enqueue: list[dict[str, float]] = ORDER, **kw: Any) -> Search:
    mg, task = setup
    kw = {"objectives": ["accuracy"], "n_trials": len(enqueue), "sampler": "random", "run_dir": tmp_path,
          "progress": False, **kw}
    return Search(PruningSpace([0.0, 0.5, 0.99], finetune=finetune), base=mg, task=task, pruner=pruner,
                  fidelity=fidelity, enqueue=enqueue, **kw)


def test_successive_halving_stops_a_bad_configuration_at_the_first_rung(setup, tmp_path: Path) -> None:
    """The dead model (sparsity 0.99) is pruned after its first 5 fine-tune steps, measured on 30 samples;
    the good ones train to 45 steps and report every rung; a trial's value is its last rung's measurement,
    and Optuna's rungs are the schedule's (rung 1 judged at 15 steps, as its promotion record shows)."""
    task = setup[1]
    task.reached, task.finished = [], 0
    result = _search(setup, tmp_path, {"steps": [5, 15, 45], "eval_samples": [30, 90, 270]},
                     "successive_halving").run()
    good, bad, best = result.study.trials
    assert [t.state for t in (good, bad, best)] == [COMPLETE, PRUNED, COMPLETE]
    assert bad.params == {"sparsity:linear": 0.99} and list(bad.intermediate_values) == [5]
    assert bad.intermediate_values[5] < 0.5 < good.intermediate_values[5]
    pruned = trial_result(bad)["pruned"]
    assert pruned["rung"] == 0 and pruned["step"] == 5 and pruned["pruner"] == "successive_halving"
    assert "rung 0 of 3 (5 train steps, 30 eval samples): accuracy" in pruned["reason"]
    assert "not in the top 1/3 of the trials measured at that rung" in pruned["reason"]
    assert [r["eval_samples"] for r in trial_result(bad)["rungs"]] == [30]
    assert task.reached == [5, 15, 5, 5, 15] and task.finished == 2  # the bad one stopped training at step 5
    for t in (good, best):
        assert list(t.intermediate_values) == [5, 15, 45]
        assert t.value == t.intermediate_values[45] == trial_result(t)["values"]["accuracy"]
        rungs = trial_result(t)["rungs"]
        assert [(r["train_steps"], r["eval_samples"]) for r in rungs] == [(5, 30), (15, 90), (45, 270)]
        assert all(round(r["values"]["accuracy"] * r["eval_samples"], 6).is_integer() for r in rungs)
        assert t.system_attrs["completed_rung_1"] == t.intermediate_values[15]
    assert best.value > good.value
    assert result.baseline["accuracy"] > 0.9  # measured on the last rung's 270 samples


def test_a_trial_without_fine_tune_has_fidelity_in_eval_samples(setup, tmp_path: Path) -> None:
    """Post-training pruning only: each rung measures the finished model on more held-out samples; the dead
    model stops after 30 of them, the others are measured on 30, 90 and 270 (the last being their value)."""
    result = _search(setup, tmp_path, Fidelity(eval_samples=(30, 90, 270)), "successive_halving",
                     finetune=False).run()
    good, bad, best = result.study.trials
    assert [t.state for t in (good, bad, best)] == [COMPLETE, PRUNED, COMPLETE]
    assert list(bad.intermediate_values) == [30] and trial_result(bad)["pruned"]["rung"] == 0
    assert "(30 eval samples)" in trial_result(bad)["pruned"]["reason"]
    for t in (good, best):
        assert list(t.intermediate_values) == [30, 90, 270] and t.value == t.intermediate_values[270]
        assert all(r["train_steps"] is None for r in trial_result(t)["rungs"])
    graph = result.rebuild(best)  # the point as exported: its value is its accuracy on all 270 samples
    assert result.search.task.accuracy(graph) == best.value


def test_hyperband_takes_its_resources_from_the_schedule(setup, tmp_path: Path) -> None:
    """Hyperband's brackets (min 5, max 45 steps, factor 3) run successive halving from the schedule's rungs:
    every trial reports only at the schedule's steps, good ones finish all three, and the dead model is
    stopped at its bracket's first rung (Optuna assigns brackets by a hash of study name and trial number:
    with this name trials 0 and 1 share bracket 0)."""
    result = _search(setup, tmp_path, TRAINED, "hyperband", study_name="hb").run()
    good, bad, best = result.study.trials
    assert [t.state for t in (good, bad, best)] == [COMPLETE, PRUNED, COMPLETE]
    assert list(bad.intermediate_values) == [5]
    assert trial_result(bad)["pruned"]["pruner"] == "hyperband"
    assert all(list(t.intermediate_values) == [5, 15, 45] for t in (good, best))


def test_several_objectives_walk_to_the_last_rung_and_refuse_a_pruner(setup, tmp_path: Path) -> None:
    """Optuna cannot report or prune a multi-objective trial (Trial.report raises NotImplementedError): with
    a pruner such a search is refused before any trial; without one each trial trains to the last rung's
    steps and is measured on its samples, recorded as one rung."""
    two = ["accuracy", "avg_weight_bits"]
    with pytest.raises(SearchError, match="pruners need a single objective"):
        _search(setup, tmp_path, TRAINED, "successive_halving", objectives=two)
    result = _search(setup, tmp_path, TRAINED, objectives=two, enqueue=ORDER[:1]).run()
    (trial,) = result.study.trials
    assert trial.state == COMPLETE and trial.intermediate_values == {}
    assert [(r["train_steps"], r["eval_samples"]) for r in trial_result(trial)["rungs"]] == [(45, 270)]


@pytest.mark.parametrize(("spec", "message"), [
    ({}, "needs steps or eval_samples"),
    ({"steps": []}, "needs steps or eval_samples"),
    ({"steps": [0, 5]}, r"positive integers, got \[0\]"),
    ({"eval_samples": [-10, 20]}, r"positive integers, got \[-10\]"),
    ({"steps": [5, 5, 10]}, "strictly increasing"),
    ({"steps": [50, 10]}, "strictly increasing"),
    ({"steps": [5.0, 10]}, "positive integers"),
    ({"steps": [True, 2]}, "positive integers"),
    ({"steps": "5,10"}, "must be a list of integers"),
    ({"steps": [5, 15], "eval_samples": [30, 90, 270]}, "one entry per rung"),
    ({"stepz": [5, 15]}, r"unknown key\(s\) \['stepz'\]"),
])
def test_a_bad_schedule_is_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SearchError, match=message):
        Fidelity.from_spec(spec)


def test_a_schedule_the_pruner_or_task_cannot_serve_is_refused_before_any_trial(setup, tmp_path: Path) -> None:
    """Optuna's successive-halving rungs are min * eta**k: a non-geometric or one-rung schedule is refused for
    it (the median pruner judges any schedule); the last rung cannot ask for more samples than the task
    holds; a task reporting on its own (report_every) would report twice."""
    with pytest.raises(SearchError, match=r"steps \[5, 10, 45\] is not such a series.*\[5, 15, 45\]"):
        _search(setup, tmp_path, {"steps": [5, 10, 45]}, "successive_halving")
    with pytest.raises(SearchError, match="at least 2 rungs"):
        _search(setup, tmp_path, {"steps": [5]}, "hyperband")
    assert _search(setup, tmp_path, {"steps": [5, 10, 45]}, "median").fidelity == Fidelity(steps=(5, 10, 45))
    with pytest.raises(SearchError, match="the task holds 270 held-out samples"):
        _search(setup, tmp_path, {"eval_samples": [100, 300]})
    task = setup[1]
    task.report_every = 5  # type: ignore[attr-defined]
    try:
        with pytest.raises(SearchError, match="report_every and a fidelity both report"):
            _search(setup, tmp_path, TRAINED)
    finally:
        del task.report_every  # type: ignore[attr-defined]
    with pytest.raises(SearchError, match="pass task="):
        Search(PruningSpace([0.5]), objectives=["param_count"], base=setup[0], fidelity=TRAINED, run_dir=tmp_path)


CONFIG = ('[search]\nstudy_name = "fid"\nn_trials = 2\nsampler = "random"\nrun_dir = "run"\n'
          'pruner = "successive_halving"\nobjectives = ["accuracy"]\n'
          '[search.fidelity]\n{fidelity}\n'
          '[model]\nname = "tiny-bert"\n'
          '[task]\ntrain_size = 8\neval_size = 16\nmax_length = 16\neval_batch_size = 8\nprogress = false\n'
          '[task.train_args]\nper_device_train_batch_size = 2\n'
          '[space]\nkind = "pruning"\nsparsity = [0.0, 0.5]\nfinetune = {finetune}\n')


def test_config_carries_the_schedule_and_refuses_a_bad_one_before_building(tmp_path: Path) -> None:
    """[search.fidelity] in a TOML config is a table the schedule round-trips through; a bad one (unknown key,
    not a table, not increasing) is refused before the model or the task is built."""
    config = tmp_path / "search.toml"
    config.write_text(CONFIG.format(fidelity="eval_samples = [4, 8, 16]", finetune="false"))
    loaded = load_config(config)
    assert Fidelity.from_spec(loaded["search"]["fidelity"]) == Fidelity(eval_samples=(4, 8, 16))
    assert Fidelity.from_spec(TRAINED.to_json()) == TRAINED
    for fidelity, message in [({"eval_sample": [4, 16]}, r"fidelity: unknown key\(s\) \['eval_sample'\]"),
                              ([4, 8, 16], "fidelity must be a table"),
                              ({"eval_samples": [8, 4]}, "strictly increasing")]:
        bad = copy.deepcopy(loaded)
        bad["search"]["fidelity"] = fidelity
        bad["model"]["name"] = "not-built"  # reached only if the schedule were accepted
        with pytest.raises(SearchError, match=message):
            search_from_config(bad, output_root=tmp_path)


@pytest.mark.slow_search
def test_config_round_trip_trains_tiny_bert_at_its_rungs(tmp_path: Path) -> None:
    """The config's schedule reaches the Search and the HF Trainer stops at each rung: tiny BERT pruned and
    fine-tuned, measured after 2 steps on 8 reviews and after 4 steps on 16; the study's stored config holds
    the schedule, so a rerun with another one is refused. (Slow: tiny BERT, its task and Trainer runs.)"""
    config = tmp_path / "search.toml"
    config.write_text(CONFIG.format(fidelity="steps = [2, 4]\neval_samples = [8, 16]", finetune="true"))
    loaded = load_config(config)
    search = search_from_config(loaded, output_root=tmp_path)
    assert search.fidelity == Fidelity(steps=(2, 4), eval_samples=(8, 16))
    assert isinstance(search.task, FidelityTask) and len(search.task.eval_batches()) == 2
    result = search.run()
    first = result.study.trials[0]
    assert first.state == COMPLETE and list(first.intermediate_values) == [2, 4]
    assert [(r["train_steps"], r["eval_samples"]) for r in trial_result(first)["rungs"]] == [(2, 8), (4, 16)]
    assert all(list(t.intermediate_values) in ([2], [2, 4]) for t in result.study.trials)
    changed = copy.deepcopy(loaded)
    changed["search"]["fidelity"]["eval_samples"] = [4, 16]
    with pytest.raises(SearchError, match=r"created from a different config \(search differ"):
        search_from_config(changed, output_root=tmp_path)
