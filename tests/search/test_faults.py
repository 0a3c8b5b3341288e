"""Fault tolerance: a worker SIGKILLed mid-trial on PostgreSQL, an embedded search killed and resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from fxforge.search.storage import StorageSpec, open_storage

SCRIPT = textwrap.dedent('''
    import sys, time, torch, torch.nn as nn
    from fxforge import ForgeGraph
    from fxforge.search import MixedPrecisionSpace, Objective, Search, TensorTask
    from fxforge.search.objectives import avg_weight_bits

    storage, study, run_dir = sys.argv[1], sys.argv[2], sys.argv[4]
    n_trials, sleep = int(sys.argv[3]), float(sys.argv[5])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    x = torch.randn(32, 8)
    mg = ForgeGraph(net, (x[:4],))

    def slow_bits(graph, task):
        time.sleep(sleep)
        return avg_weight_bits(graph)

    space = MixedPrecisionSpace({"integer": {"width": [2, 3, 4, 5, 6, 7, 8], "frac_width": [1, 2]}},
                                roles=("weight", "data_in"), per="layer")
    Search(space, [Objective("slow_bits", "minimize", slow_bits)], base=mg, task=None, n_trials=n_trials,
           sampler="random", seed=None, storage=None if storage == "-" else storage, study_name=study,
           run_dir=run_dir, resume=True, progress=False).run()
''')


def _spawn(script: Path, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_running(storage: optuna.storages.BaseStorage, name: str, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            study = optuna.load_study(study_name=name, storage=storage)
            # a running trial that has sampled its parameters (killed earlier, it has nothing to retry with)
            if any(t.state == optuna.trial.TrialState.RUNNING and t.params for t in study.get_trials(deepcopy=False)):
                return
        except KeyError:
            pass
        time.sleep(0.2)
    raise AssertionError("no trial started")


def test_killed_postgres_worker_trial_is_retried_and_study_completes(postgres_url: str, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    storage = open_storage(StorageSpec(postgres_url), tmp_path)
    victim = _spawn(script, postgres_url, "kill", 6, tmp_path, 4.0)
    _wait_running(storage, "kill")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    spec = StorageSpec(postgres_url)  # let the dead worker's heartbeat go stale, so the first survivor trial sees it
    time.sleep(spec.grace_period + spec.heartbeat_interval)
    survivors = [_spawn(script, postgres_url, "kill", 6, tmp_path, 0.5) for _ in range(2)]
    for p in survivors:
        assert p.wait(timeout=240) == 0, p.stderr.read().decode()[-2000:]
    study = optuna.load_study(study_name="kill", storage=storage)
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 6
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1  # the killed worker's trial, failed by a survivor's heartbeat check ...
    retried = [t for t in study.trials
               if optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == failed[0].number]
    assert len(retried) == 1 and retried[0].params == failed[0].params  # ... and re-run with its parameters


def test_embedded_search_killed_then_resumed_keeps_finished_trials_once(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    first = _spawn(script, "-", "emb", 8, tmp_path, 0.3)
    storage = open_storage(StorageSpec(), tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once at least two trials finished and one is running
        try:
            trials = optuna.load_study(study_name="emb", storage=storage).get_trials(deepcopy=False)
        except KeyError:
            trials = []
        if sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) >= 2 and \
                trials[-1].state == optuna.trial.TrialState.RUNNING:
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = {t.number: t.values for t in optuna.load_study(study_name="emb", storage=storage).trials
              if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(before) >= 2
    second = _spawn(script, "-", "emb", 8, tmp_path, 0.0)
    assert second.wait(timeout=240) == 0, second.stderr.read().decode()[-2000:]
    study = optuna.load_study(study_name="emb", storage=open_storage(StorageSpec(), tmp_path))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 8
    assert {t.number: t.values for t in complete if t.number in before} == before  # kept, once each
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:1/none"])
def test_worker_with_unreachable_storage_exits_with_one_line(url: str, tmp_path: Path) -> None:
    from fxforge.search import SearchError, worker

    with pytest.raises(SearchError, match="cannot open study storage"):
        worker("x", url)
