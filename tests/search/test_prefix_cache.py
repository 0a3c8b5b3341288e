"""The prefix cache: a trial differing from an earlier one only after its fine-tune is served the earlier
trial's trained graph (counted), equal to a recompute; any other prefix misses; an entry edited on disk
is refused and recomputed; racing writers leave one valid entry; entries are capped in size."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.search import JointSpace, MixedPrecisionSpace, PruningSpace, Search, TensorTask, runner
from fxforge.search.prefix_cache import PrefixCache, PrefixCacheWarning
from fxforge.search.runner import plan_pipelines, run_plan, trial_result


class _TrainingTask(TensorTask):
    """A TensorTask that fine-tunes two seeded SGD steps (noisy inputs: training draws random numbers, seeded
    as the HF Trainer seeds itself), reporting accuracy after each step and counting its trainings."""

    def __init__(self, inner: TensorTask, lr: float = 0.05) -> None:
        self.__dict__.update(inner.__dict__)
        self.lr, self.trainings = lr, 0

    def train(self, graph: ForgeGraph, trial: Any) -> None:
        self.trainings += 1
        gen = torch.Generator().manual_seed(0)
        params = [p for p in graph.model.parameters() if p.requires_grad]
        graph.model.train()
        for step, (inputs, labels) in enumerate(self.eval_batches()[:2]):
            noisy = inputs["x"] + 0.1 * torch.randn(inputs["x"].shape, generator=gen)
            grads = torch.autograd.grad(F.cross_entropy(graph.model(noisy), labels), params)
            with torch.no_grad():  # SGD by hand: torch.optim's first step imports torch._dynamo (~3 s)
                for p, g in zip(params, grads):
                    p.sub_(g, alpha=self.lr)
            if trial is not None:
                trial.report(self.accuracy(graph), step)
        graph.model.eval()

    def prefix_fingerprint(self) -> Any:
        return {"sgd": {"lr": self.lr, "steps": 2}}


SPACE = JointSpace(PruningSpace([0.25, 0.5], groups={"fc1": {"name": ["fc1"]}}, granularity="row", shrink=True,
                                finetune=True),
                   MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2]}}, roles=("weight",)))
W = "linear:integer:weight_width"


@pytest.fixture
def setup() -> tuple[ForgeGraph, _TrainingTask, torch.Tensor]:
    mg, task = tiny_search_setup(96)
    return mg, _TrainingTask(task), torch.randn(5, 8)


def _plan(sparsity: float, width: int) -> Any:
    return SPACE.suggest(optuna.trial.FixedTrial({"sparsity:fc1": sparsity, W: width}))


def _run(mg: ForgeGraph, task: Any, plan: Any, cache: PrefixCache | None,
         trial: Any = None) -> tuple[ForgeGraph, dict[str, Any]]:
    graph, notes = mg.copy(), {}  # type: ForgeGraph, dict[str, Any]
    out = run_plan(graph, plan, plan_pipelines(plan, task, graph, "t"), task, trial, cache, notes)
    return out, notes


def _same(a: ForgeGraph, b: ForgeGraph, x: torch.Tensor) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert [r.to_json() for r in a.history] == [r.to_json() for r in b.history]


def test_a_trial_differing_after_training_is_served_and_equals_a_recompute(setup, tmp_path: Path) -> None:
    mg, task, x = setup
    cache = PrefixCache(tmp_path / "cache", mg)
    study = optuna.create_study(direction="maximize")
    first, second = study.ask(), study.ask()
    g4, n4 = _run(mg, task, _plan(0.5, 4), cache, first)
    assert n4 == {"prefix_cache": "miss"} and task.trainings == 1 and len(cache.entries()) == 1
    g8, n8 = _run(mg, task, _plan(0.5, 8), cache, second)
    assert n8 == {"prefix_cache": "hit"} and task.trainings == 1  # not trained again
    assert [type(m).__name__ for m in g8.model.modules()] == [type(m).__name__ for m in g4.model.modules()]
    assert g8.model.fc1.out_features == 8  # pruned and shrunk, as the entry was
    # the trained reports replayed to the served trial, as a recompute would report them
    got = study._storage.get_trial(second._trial_id).intermediate_values
    assert got == study._storage.get_trial(first._trial_id).intermediate_values and len(got) == 2
    uncached, notes = _run(mg, task, _plan(0.5, 8), None)
    assert notes == {} and task.trainings == 2
    _same(g8, uncached, x)  # a hit is the graph a recompute gives, weights, outputs and history


def test_search_records_hits_and_counts_prefix_work(tmp_path: Path, monkeypatch) -> None:
    mg, plain_task = tiny_search_setup(96)
    x, labels = plain_task.eval_batches()[0]
    task = TensorTask({"x": torch.cat([b[0]["x"] for b in plain_task.eval_batches()])},
                      torch.cat([b[1] for b in plain_task.eval_batches()]), batch_size=32,
                      training=(x, labels), train_steps=3)  # TensorTask's own fine-tune, keyed by its recipe
    befores: list[str] = []
    trainings: list[int] = []
    apply, train = runner.apply_steps, TensorTask.train

    def counting(graph: ForgeGraph, pipeline: Any) -> ForgeGraph:
        if pipeline is not None and pipeline.name.endswith("before training"):
            befores.append(pipeline.name)
        return apply(graph, pipeline)

    def counted_train(self: TensorTask, *args: Any, **kwargs: Any) -> None:
        trainings.append(1)
        train(self, *args, **kwargs)

    monkeypatch.setattr(runner, "apply_steps", counting)
    monkeypatch.setattr(TensorTask, "train", counted_train)
    args: dict[str, Any] = dict(space=SPACE, objectives=["accuracy"], base=mg, task=task, n_trials=2, sampler="random",
                                progress=False, enqueue=[{"sparsity:fc1": 0.5, W: 4}, {"sparsity:fc1": 0.5, W: 8}])
    cached = Search(**args, run_dir=tmp_path / "a").run()
    assert [trial_result(t)["prefix_cache"] for t in cached.completed()] == ["miss", "hit"]
    assert len(trainings) == 1 and befores == ["trial 0: before training"]
    assert len(list((tmp_path / "a" / "prefix-cache").iterdir())) == 1
    plain = Search(**args, run_dir=tmp_path / "b", prefix_cache=None).run()
    assert len(trainings) == 3 and len(befores) == 3
    assert all("prefix_cache" not in trial_result(t) for t in plain.completed())
    assert [t.values for t in cached.completed()] == [t.values for t in plain.completed()]
    task.learning_rate = 0.01  # another recipe: the same plans miss
    again = Search(**args, run_dir=tmp_path / "a", study_name="lr").run()
    assert [trial_result(t)["prefix_cache"] for t in again.completed()] == ["miss", "hit"] and len(trainings) == 4


def test_a_changed_prefix_base_or_training_misses(setup, tmp_path: Path) -> None:
    mg, task, _ = setup
    cache = PrefixCache(tmp_path, mg)
    assert _run(mg, task, _plan(0.5, 4), cache)[1] == {"prefix_cache": "miss"}
    assert _run(mg, task, _plan(0.25, 4), cache)[1] == {"prefix_cache": "miss"}  # another sparsity
    other = mg.copy()
    with torch.no_grad():
        other.model.fc2.bias[0] += 1e-3  # one weight of the base differs
    assert _run(other, task, _plan(0.5, 4), PrefixCache(tmp_path, other))[1] == {"prefix_cache": "miss"}
    slower = _TrainingTask(task, lr=0.01)  # trains differently
    assert _run(mg, slower, _plan(0.5, 4), cache)[1] == {"prefix_cache": "miss"}
    assert task.trainings + slower.trainings == 4 and len(cache.entries()) == 4
    assert _run(mg, task, _plan(0.5, 8), cache)[1] == {"prefix_cache": "hit"}
    untold = TensorTask.__new__(type("Untold", (_TrainingTask,), {"prefix_fingerprint": None}))
    untold.__dict__.update(task.__dict__)  # trains but says nothing about how: never cached
    assert _run(mg, untold, _plan(0.5, 4), cache)[1] == {"prefix_cache": "skip"}
    quantize_only = SPACE.spaces[1].suggest(optuna.trial.FixedTrial({W: 4}))  # nothing before training: no entry
    assert _run(mg, task, quantize_only, cache)[1] == {} and len(cache.entries()) == 4


def _edit_weights(entry: Path) -> None:
    f = entry / "graph" / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))


def _edit_reports(entry: Path) -> None:
    doc = json.loads((entry / "prefix.json").read_text())
    doc["reports"] = [[0, 1.0]]
    (entry / "prefix.json").write_text(json.dumps(doc))


def _edit_key(entry: Path) -> None:
    doc = json.loads((entry / "prefix.json").read_text())
    doc["key"] = "0" * 64
    (entry / "prefix.json").write_text(json.dumps(doc))


EDITS: dict[str, Any] = {
    "weights": _edit_weights, "key": _edit_key, "reports": _edit_reports,
    "extra-file": lambda e: (e / "graph" / "extra.json").write_text("{}"),
    "missing-file": lambda e: (e / "graph" / "metadata.json").unlink(),
    "missing-manifest": lambda e: (e / "prefix.json").unlink(),
    "symlink": lambda e: (e / "graph" / "evil").symlink_to("/etc/passwd"),
}


def test_an_entry_edited_on_disk_is_refused_and_recomputed(setup, tmp_path: Path) -> None:
    mg, task, x = setup
    cache = PrefixCache(tmp_path, mg)
    first, _ = _run(mg, task, _plan(0.5, 4), cache)
    for n, (name, edit) in enumerate(EDITS.items(), start=2):
        [entry] = cache.entries()
        edit(entry)
        with pytest.warns(PrefixCacheWarning, match="refused"):
            again, notes = _run(mg, task, _plan(0.5, 4), cache)
        assert notes == {"prefix_cache": "miss"} and task.trainings == n, name  # recomputed, never loaded
        _same(first, again, x)
    assert _run(mg, task, _plan(0.5, 8), cache)[1] == {"prefix_cache": "hit"}  # rewritten whole
    assert task.trainings == len(EDITS) + 1


def test_racing_writers_leave_one_valid_entry(setup, tmp_path: Path) -> None:
    mg, task, x = setup
    plan = _plan(0.5, 4)
    graph, _ = _run(mg, task, plan, None)  # the prefix as both workers computed it
    workers = [PrefixCache(tmp_path, mg) for _ in range(4)]  # one per worker (process), one shared directory
    key = workers[0].key(plan, task, False)
    assert key is not None and all(w.key(plan, task, False) == key for w in workers) and workers[0].load(key) is None
    start, stored = threading.Barrier(len(workers)), []

    def write(cache: PrefixCache) -> None:
        start.wait()
        stored.append(cache.store(key, graph, [(0, 0.5)]))

    threads = [threading.Thread(target=write, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stored == [tmp_path / key] * len(workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == [key]  # no temporary left behind
    entry = workers[1].load(key)
    assert entry is not None and entry.reports == ((0, 0.5),)
    _same(entry.graph, graph, x)


def test_entries_beyond_the_size_cap_are_evicted_least_recently_used_first(setup, tmp_path: Path) -> None:
    mg, task, _ = setup
    cache = PrefixCache(tmp_path, mg)
    _run(mg, task, _plan(0.5, 4), cache)
    [one] = cache.entries()
    _run(mg, task, _plan(0.25, 4), cache)
    cache.max_bytes = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) + 1  # room for these two
    assert _run(mg, task, _plan(0.5, 8), cache)[1] == {"prefix_cache": "hit"}  # the first one is used again
    slower = _TrainingTask(task, lr=0.01)
    _run(mg, slower, _plan(0.5, 4), cache)  # a third entry: the least recently used (sparsity 0.25) goes
    assert len(cache.entries()) == 2 and one in cache.entries()
    assert _run(mg, task, _plan(0.25, 8), cache)[1] == {"prefix_cache": "miss"}


def test_a_multi_fidelity_trial_is_served_its_fully_trained_prefix(tmp_path: Path) -> None:
    mg, plain = tiny_search_setup(96)
    xs, ys = torch.cat([b[0]["x"] for b in plain.eval_batches()]), torch.cat([b[1] for b in plain.eval_batches()])
    task = TensorTask({"x": xs}, ys, batch_size=32, training=({"x": xs[:32]}, ys[:32]), train_steps=3)
    args: dict[str, Any] = dict(space=SPACE, objectives=["accuracy"], base=mg, task=task, n_trials=2, sampler="random",
                                progress=False, pruner="successive_halving", fidelity={"steps": [1, 3]},
                                enqueue=[{"sparsity:fc1": 0.5, W: 4}, {"sparsity:fc1": 0.5, W: 8}])
    cached = Search(**args, run_dir=tmp_path / "a").run().study.trials
    uncached = Search(**args, run_dir=tmp_path / "b", prefix_cache=None).run().study.trials
    assert [trial_result(t)["prefix_cache"] for t in cached] == ["miss", "hit"]
    assert [[r["rung"] for r in trial_result(t)["rungs"]] for t in cached] == [[0, 1], [1]]  # a hit: trained already,
    assert [t.values for t in cached] == [t.values for t in uncached]  # measured at the last rung only, same value
