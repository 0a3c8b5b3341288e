"""Search results as MLflow runs (issue 30): one run per finished trial under a parent run per study, read
back through MLflow's own client; pruned and failed trials with their state; a bad tracking URI refused
before any trial; mlflow imported only when asked."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.search import Constraint, MixedPrecisionSpace, Search, SearchError, TensorTask
from fxforge.search.config import search_from_config
from fxforge.search.runner import trial_plan_key
from fxforge.search.storage import open_storage

SPACE = MixedPrecisionSpace({"integer": {"width": [2, 3, 4, 8], "frac_width": [1, 2]}}, roles=("weight", "data_in"),
                            per="layer")


@pytest.fixture(scope="module")
def setup() -> tuple[ForgeGraph, TensorTask]:
    return tiny_search_setup(64)


@pytest.fixture
def file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A temporary MLflow file store (MLflow 3 opens one only when MLFLOW_ALLOW_FILE_STORE is set)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def _search(setup: tuple[ForgeGraph, TensorTask], run_dir: Path, **kw: Any) -> Search:
    mg, task = setup
    args: dict[str, Any] = dict(space=SPACE, objectives=["accuracy", "avg_weight_bits"], base=mg, task=task,
                                n_trials=4, sampler="random", run_dir=run_dir, progress=False, study_name="mlf")
    return Search(**{**args, **kw})


def _runs(uri: str, study: str) -> tuple[Any, dict[int, Any]]:
    """The study's parent run and its trial runs by trial number, as MLflow holds them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(study)
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("fxforge.role") == "study"]
    trials = [r for r in runs if r.data.tags.get("fxforge.role") == "trial"]
    assert len(parents) == 1
    by_number = {int(r.data.tags["fxforge.trial"]): r for r in trials}
    assert len(by_number) == len(trials)  # no trial logged twice
    return parents[0], by_number


def test_one_run_per_trial_with_its_params_and_objectives(setup, tmp_path: Path, file_store: str) -> None:
    search = _search(setup, tmp_path / "run", mlflow=file_store, constraints=[Constraint("accuracy", max_drop=0.5)])
    result = search.run()
    parent, runs = _runs(file_store, "mlf")
    trials = result.study.trials
    assert sorted(runs) == [t.number for t in trials] == [0, 1, 2, 3]
    for t in trials:
        run = runs[t.number]
        assert run.data.params == {k: str(v) for k, v in t.params.items()} and len(t.params) == 8
        assert run.data.metrics["accuracy"] == pytest.approx(t.values[0])
        assert run.data.metrics["avg_weight_bits"] == pytest.approx(t.values[1])
        assert run.data.metrics["trial_number"] == t.number
        assert "constraint_accuracy" in run.data.metrics and "timing_s_measure" in run.data.metrics
        assert run.info.status == "FINISHED" and run.data.tags["fxforge.state"] == "COMPLETE"
        assert run.data.tags["fxforge.plan_key"] == trial_plan_key(t)
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.info.status == "FINISHED" and parent.data.metrics["baseline_accuracy"] == 1.0
    assert parent.data.tags["fxforge.objectives"] == "accuracy,avg_weight_bits"
    # a resume logs its new trials under the same parent, none of the old ones again
    _search(setup, tmp_path / "run", mlflow=file_store, n_trials=6, resume=True).run()
    parent2, runs = _runs(file_store, "mlf")
    assert sorted(runs) == list(range(6)) and parent2.info.run_id == parent.info.run_id


def test_trials_finished_before_logging_was_on_are_logged_on_the_next_run(setup, tmp_path: Path,
                                                                          file_store: str) -> None:
    _search(setup, tmp_path / "run", n_trials=2).run()
    result = _search(setup, tmp_path / "run", n_trials=3, resume=True, mlflow=file_store).run()
    _, runs = _runs(file_store, "mlf")
    assert sorted(runs) == [0, 1, 2]
    assert {n: r.data.params for n, r in runs.items()} == {t.number: {k: str(v) for k, v in t.params.items()}
                                                           for t in result.study.trials}


def test_a_store_failing_mid_search_stops_no_search_and_the_next_run_catches_up(
        setup, tmp_path: Path, file_store: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from fxforge.search.mlflow_log import MlflowTrialLog

    original = MlflowTrialLog.log_trial

    def failing(self: MlflowTrialLog, trial: optuna.trial.FrozenTrial) -> str:
        if trial.number == 1:
            raise OSError("no space left on device")
        return original(self, trial)

    monkeypatch.setattr(MlflowTrialLog, "log_trial", failing)
    result = _search(setup, tmp_path / "run", n_trials=3, mlflow=file_store).run()
    assert len(result.completed()) == 3 and "could not log trial 1 (no space left on device)" in caplog.text
    assert sorted(_runs(file_store, "mlf")[1]) == [0]  # nothing more after the failure: no waiting on a dead store
    monkeypatch.setattr(MlflowTrialLog, "log_trial", original)
    _search(setup, tmp_path / "run", n_trials=3, mlflow=file_store, resume=True).run()  # no trial left to run
    assert sorted(_runs(file_store, "mlf")[1]) == [0, 1, 2]


def test_an_unreachable_tracking_server_is_refused_before_the_first_trial(setup, tmp_path: Path) -> None:
    import socket

    with socket.socket() as free:  # a loopback port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    search = _search(setup, tmp_path / "run", mlflow=f"http://127.0.0.1:{port}")
    with pytest.raises(SearchError, match="cannot reach the tracking server"):
        search.run()
    study = optuna.load_study(study_name="mlf", storage=open_storage(search.storage_spec(), tmp_path / "run"))
    assert study.trials == []


class _FlakyTask(TensorTask):
    """A TensorTask whose 2nd and 4th trial evaluations prune and fail the trial (the 1st call is the baseline)."""

    calls = 0

    def accuracy(self, graph: ForgeGraph) -> float:
        self.calls += 1
        if self.calls == 3:
            raise optuna.TrialPruned("pruned by the test")
        if self.calls == 5:
            raise RuntimeError("trial broke")
        return super().accuracy(graph)


def test_pruned_and_failed_trials_are_logged_with_their_state(setup, tmp_path: Path, file_store: str) -> None:
    mg, task = setup
    flaky = _FlakyTask({"x": task.eval_batches()[0][0]["x"]}, task.eval_batches()[0][1], batch_size=32)
    search = _search(setup, tmp_path / "run", mlflow=file_store, task=flaky, objectives=["accuracy"], n_trials=6)
    with pytest.raises(RuntimeError, match="trial broke"):  # the failure ends the search (Optuna calls no callback)
        search.run()
    study = optuna.load_study(study_name="mlf", storage=open_storage(search.storage_spec(), tmp_path / "run"))
    states = {t.number: t.state.name for t in study.trials}
    assert sorted(states.values()) == ["COMPLETE", "COMPLETE", "FAIL", "PRUNED"], states
    parent, runs = _runs(file_store, "mlf")
    assert {n: r.data.tags["fxforge.state"] for n, r in runs.items()} == states
    status = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
    assert {n: r.info.status for n, r in runs.items()} == {n: status[s] for n, s in states.items()}
    failed = next(r for r in runs.values() if r.data.tags["fxforge.state"] == "FAIL")
    assert "accuracy" not in failed.data.metrics and failed.data.params  # its parameters, no value
    assert parent.info.status == "FAILED"


@pytest.mark.parametrize("uri", ["postgresql://user@host/db", "sqlite:/x.db", "sqlite//x.db", "sqlite:///",
                                 "file://host/x", "file:/x", "http://", "https://h:99999", "http://h/?q=1",
                                 "ftp://h/x", "s3://bucket/runs", "databricks", "", " runs", "runs\n", "a?b", 3,
                                 "under_a_file/x", "file store without MLFLOW_ALLOW_FILE_STORE"])
def test_bad_tracking_uri_is_refused_before_any_trial(setup, tmp_path: Path, uri: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "under_a_file").write_text("a file, not a directory")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    given = {"under_a_file/x": str(tmp_path / "under_a_file/x"),
             "file store without MLFLOW_ALLOW_FILE_STORE": (tmp_path / "mlruns").as_uri()}.get(uri, uri)
    run_dir = tmp_path / "run"
    with pytest.raises(SearchError, match="mlflow"):
        _search(setup, run_dir, mlflow=given)
    assert not run_dir.exists()  # no study, no store: nothing ran


def test_config_key_is_typed_and_its_local_store_confined(tmp_path: Path) -> None:
    config: dict[str, Any] = {"search": {"mlflow": 3}, "space": {"kind": "precision"}}
    with pytest.raises(SearchError, match="mlflow must be true/false or a tracking URI"):
        search_from_config(config, output_root=tmp_path)
    config["search"]["mlflow"] = str(tmp_path.parent / "elsewhere")
    with pytest.raises(SearchError, match=r"\[search\] mlflow = .* is absolute"):
        search_from_config(config, output_root=tmp_path)
    config["search"]["mlflow"] = "sqlite:///../up.db"
    with pytest.raises(SearchError, match=r"\[search\] mlflow = '../up.db' goes up"):
        search_from_config(config, output_root=tmp_path)


def test_search_without_mlflow_never_imports_it(setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now raises ImportError
    monkeypatch.delitem(sys.modules, "fxforge.search.mlflow_log")
    importlib.import_module("fxforge.search.mlflow_log")  # the module itself imports no mlflow
    result = _search(setup, tmp_path / "a", n_trials=2).run()
    assert len(result.study.trials) == 2
    with pytest.raises(SearchError, match="needs the mlflow-skinny package"):  # asked for: refused before a trial
        _search(setup, tmp_path / "b", n_trials=2, mlflow=str(tmp_path / "b" / "mlflow"))
    assert not (tmp_path / "b").exists()


@pytest.mark.slow_search
def test_default_store_is_sqlite_in_the_run_dir(setup, tmp_path: Path) -> None:
    """mlflow=True: the SQLite store MLflow recommends, in run_dir/mlflow (creating it migrates its schema,
    seconds: marked slow; the file-store tests above cover the same logging code)."""
    result = _search(setup, tmp_path / "run", n_trials=2, mlflow=True).run()
    db = tmp_path / "run" / "mlflow" / "mlflow.db"
    assert db.is_file()
    _, runs = _runs(f"sqlite:///{db}", "mlf")
    assert sorted(runs) == [t.number for t in result.study.trials]


def test_logging_does_not_opt_the_user_into_mlflow_telemetry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxforge.search.mlflow_log import MlflowTrialLog, mlflow_target

    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store opens in milliseconds, SQLite in seconds
    log = MlflowTrialLog.__new__(MlflowTrialLog)
    log.target = mlflow_target((tmp_path / "store").as_uri(), tmp_path)
    log._open_client()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")  # a user's own choice is kept
    log._open_client()
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "false"
