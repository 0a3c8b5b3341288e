"""Searches described as data: a valid config runs, a rerun continues its study (and only its own), a
worker joins a study from the config stored in it; the latency_ms and weight_bits objectives measure."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.search import SearchError, TensorTask, load_config, search_from_config, worker
from fxforge.search.objectives import OBJECTIVES, Measurement, latency_ms, weight_bits

CONFIG: dict[str, Any] = {
    "search": {"study_name": "tiny", "n_trials": 2, "sampler": "random", "objectives": ["accuracy", "weight_bits"]},
    "model": {"name": "tiny-bert"},
    "task": {"train_size": 8, "eval_size": 16, "max_length": 16, "eval_batch_size": 8, "progress": False},
    "space": {"kind": "precision", "formats": {"integer": {"width": [4, 8], "frac_width": [2, 3]}}},
}


def _config(tmp_path: Path, **search: Any) -> dict[str, Any]:
    config = copy.deepcopy(CONFIG)
    config["search"].update(run_dir="run", **search)  # under the output root each call gives (tmp_path)
    return config


def test_config_runs_and_a_rerun_continues_only_its_own_study(tmp_path: Path) -> None:
    """The zoo's tiny BERT, quantized per trial: weight_bits is what the rebuilt graph holds and less than the
    fp32 base; rerunning the config with a larger n_trials adds trials to the same study; a config that
    changed (another task) or resume = false is refused before anything runs."""
    first = search_from_config(_config(tmp_path), output_root=tmp_path).run()
    assert len(first.completed()) == 2
    base_bits = first.baseline["weight_bits"]
    trial = first.completed()[0]
    assert trial.values[1] == weight_bits(first.rebuild(trial)) < base_bits
    params = [t.params for t in first.completed()]
    again = search_from_config(_config(tmp_path), n_trials=3, output_root=tmp_path).run()
    assert [t.number for t in again.completed()] == [0, 1, 2]
    assert [t.params for t in again.completed()[:2]] == params
    changed = _config(tmp_path)
    changed["task"]["eval_size"] = 32
    with pytest.raises(SearchError, match=r"study 'tiny' exists, created from a different config \(task differ"):
        search_from_config(changed, output_root=tmp_path)
    with pytest.raises(SearchError, match="already exists"):
        search_from_config(_config(tmp_path, resume=False), output_root=tmp_path).run()


def test_worker_joins_a_study_from_its_stored_config(tmp_path: Path) -> None:
    """search/worker.py's normal path: the study is created from a config over SQLite, then a worker that
    only knows the storage and the study name rebuilds the search from the study and runs its trials."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    search_from_config(_config(tmp_path, n_trials=1), storage=url, output_root=tmp_path).run()
    result = worker("tiny", url, n_trials=2)
    study = optuna.load_study(study_name="tiny", storage=url)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert len(result.completed()) == 2 and all(len(t.params) == 6 for t in study.trials)
    with pytest.raises(SearchError, match="no study named 'other'"):
        worker("other", url)


def test_load_config_refuses_hostile_files_naming_them(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(SearchError, match=r"big\.toml: \d+ bytes is larger than the 1048576 allowed for a search"):
        load_config(big)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[search]\nstudy_name = "caf\xe9"\n')
    with pytest.raises(SearchError, match=r"latin\.toml: search config is not UTF-8 text"):
        load_config(latin)
    with pytest.raises(SearchError, match=r"is a directory, not a search config"):
        load_config(tmp_path)
    with pytest.raises(SearchError, match=r"nothing\.toml: no such search config"):
        load_config(tmp_path / "nothing.toml")


class _Sleep(nn.Module):
    """Identity that sleeps a known time (a leaf of the captured graph, so the graph calls it)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_latency_objective_times_the_graph_on_the_tasks_batch() -> None:
    """A forward that sleeps 20 ms measures at least 20 ms (the median of repeats, after a warm-up), on the
    task's first eval batch, else on the graph's example inputs; the objective minimises it."""
    graph = ForgeGraph(nn.Sequential(_Sleep(0.02), nn.Linear(4, 3)), (torch.randn(2, 4),), leaf_modules=(_Sleep,))
    assert 20.0 <= latency_ms(graph, None) < 200.0
    task = TensorTask({"input": torch.randn(8, 4)}, torch.zeros(8, dtype=torch.long), batch_size=8)
    graph.model.get_submodule("0").seconds = 0.04
    measured = OBJECTIVES["latency_ms"].measure(graph, task)  # nothing quantized: the graph itself, noted "float"
    assert isinstance(measured, Measurement) and 40.0 <= measured.value < 400.0
    assert measured.notes["timed"] == "float"
    assert OBJECTIVES["latency_ms"].direction == "minimize"
    assert graph.model.training  # the timing ran in eval mode and restored the mode it found


def test_weight_bits_counts_each_weight_at_its_stored_format() -> None:
    """fp32 weights count 32 bits each; a Linear quantized to 8-bit weights and 4-bit biases counts those."""
    from fxforge import passes

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    graph = ForgeGraph(net, (torch.randn(2, 4),))
    assert weight_bits(graph) == 32 * (4 * 3 + 3 + 3 * 2 + 2)
    config = {"by": "name", "default": {"config": {"name": None}},
              "0": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4, "weight_width": 8,
                               "weight_frac_width": 4, "bias_width": 4, "bias_frac_width": 2}}}
    quantized, _ = passes.quantize_transform_pass(graph.copy(), config)
    assert weight_bits(quantized) == 8 * 12 + 4 * 3 + 32 * (3 * 2 + 2)
    assert OBJECTIVES["weight_bits"].measure(quantized, None) == weight_bits(quantized)


@pytest.mark.filterwarnings("ignore::fxforge.passes.quantize.zeroed.QuantizationWarning")  # CONFIG's coarse space
def test_prefix_cache_key_is_typed_confined_and_off_when_false(tmp_path: Path) -> None:
    config = _config(tmp_path, objectives=["weight_bits"])
    del config["task"]  # building the search is enough; no trial runs
    default = search_from_config(config, output_root=tmp_path)
    assert default._prefix_cache is not None and default._prefix_cache.root == tmp_path / "run" / "prefix-cache"
    off = search_from_config({**config, "search": {**config["search"], "prefix_cache": False}}, output_root=tmp_path)
    assert off._prefix_cache is None
    named = search_from_config({**config, "search": {**config["search"], "prefix_cache": "shared-cache"}},
                               output_root=tmp_path)
    assert named._prefix_cache is not None and named._prefix_cache.root == tmp_path / "shared-cache"
    with pytest.raises(SearchError, match="prefix_cache"):
        search_from_config({**config, "search": {**config["search"], "prefix_cache": "../outside"}},
                           output_root=tmp_path)
    with pytest.raises(SearchError, match="prefix_cache"):
        search_from_config({**config, "search": {**config["search"], "prefix_cache": 3}}, output_root=tmp_path)
