"""Search trials as MLflow runs: one run per finished trial (complete, pruned or failed), nested under one
parent run per study, in the experiment named after the study — where users already look for results,
besides the study's own JSON/CSV/HTML.

The target is user input, checked before the first trial (:func:`mlflow_target`, no mlflow import): a plain
directory (an SQLite store ``DIR/mlflow.db`` with artifacts in ``DIR/artifacts``), ``sqlite:///FILE``,
``file:///DIR`` (MLflow's file store, which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE=true``), or a
tracking server ``http(s)://HOST[:PORT][/PATH]``; anything else is refused. ``mlflow`` itself is imported
only when a search asks for it. Logging never stops a search: a run that cannot be written is warned about
and written by the next run of the study, which logs every finished trial MLflow does not hold yet.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import posixpath
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from .errors import SearchError
from .paths import check_writable_file

if TYPE_CHECKING:
    import optuna

__all__ = ["MLFLOW_FORMS", "MlflowTarget", "MlflowTrialLog", "confine_local_target", "mlflow_target"]

MLFLOW_FORMS = "a directory, sqlite:///FILE, file:///DIR or http(s)://HOST[:PORT][/PATH]"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:|(?:sqlite|file|https?)//", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BAD_KEY = re.compile(r"[^\w.\- :]", re.ASCII)  # what MLflow accepts in a param or metric name, less '/'
_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
_ROLE, _TRIAL, _STUDY = "fxforge.role", "fxforge.trial", "fxforge.study"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MlflowTarget:
    """Where runs go: the tracking URI, the artifact location of a new experiment (None: the store's own
    default) and the target as shown in messages (a server's password masked)."""

    uri: str
    artifacts: str | None
    shown: str


def mlflow_target(value: Any, run_dir: str | Path) -> MlflowTarget | None:
    """The checked target of ``Search(mlflow=value)``: None when off, ``True`` for ``run_dir/mlflow``;
    SearchError for anything but the forms of MLFLOW_FORMS, or a local store that cannot be written."""
    if value is None or value is False:
        return None
    if importlib.util.find_spec("mlflow") is None:  # found without importing it
        raise SearchError("mlflow logging needs the mlflow-skinny package (pip install mlflow-skinny)")
    if value is True:
        return _directory(Path(run_dir) / "mlflow", "mlflow")
    if not isinstance(value, str):
        raise SearchError(f"mlflow must be true or a string ({MLFLOW_FORMS}), got {type(value).__name__}")
    what = f"mlflow {value[:200]!r}"
    if not value.strip() or value != value.strip() or _CONTROL.search(value):
        raise SearchError(f"{what}: empty, padded or holding control characters; give {MLFLOW_FORMS}")
    low = value.lower()
    if low.startswith(("http://", "https://")):
        return _server(value, what)
    if low.startswith("sqlite:///"):
        path = _local(value[len("sqlite:///"):], what)
        if not path.name or value.endswith("/"):
            raise SearchError(f"{what}: an SQLite URI names a file after three slashes; give {MLFLOW_FORMS}")
        file = check_writable_file(path, what).absolute()
        return MlflowTarget(f"sqlite:///{file}", (file.parent / "mlflow-artifacts").as_uri(), value)
    if low.startswith("file://"):
        if not low.startswith("file:///"):
            raise SearchError(f"{what}: a file URI names a local directory (file:///DIR), not a host")
        path = _local(unquote(value[len("file://"):]), what)
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
            raise SearchError(f"{what}: MLflow 3 opens its file store only with MLFLOW_ALLOW_FILE_STORE=true in "
                              "the environment; or give a directory (an SQLite store in it) or sqlite:///FILE")
        check_writable_file(path / "meta.yaml", what)
        return MlflowTarget(path.absolute().as_uri(), None, value)
    if _SCHEME.match(value) or low in ("databricks", "databricks-uc"):
        raise SearchError(f"{what}: not a tracking URI fxforge writes to (a malformed one would be taken as a "
                          f"directory); give {MLFLOW_FORMS}")
    return _directory(_local(value, what), what)



def confine_local_target(value: str, resolve: Callable[[str], str]) -> str:
    """``value`` with the path of a local store (directory, ``sqlite:///``, ``file:///``) passed through
    ``resolve`` (a config's output-root confinement); a server URL, or anything mlflow_target refuses, as given."""
    low = value.lower()
    if low.startswith("sqlite:///") and len(value) > len("sqlite:///"):
        return f"sqlite:///{resolve(value[len('sqlite:///'):])}"
    if low.startswith("file:///"):
        return Path(resolve(unquote(value[len("file://"):]))).absolute().as_uri()
    if _SCHEME.match(value) or not value.strip():
        return value
    return resolve(value)


def _local(path: str, what: str) -> Path:
    """A local path of a store, refusing characters that would change the meaning of the URI built from it."""
    if not path or any(c in path for c in "?#%"):
        raise SearchError(f"{what}: a local store needs a path without '?', '#' or '%'; give {MLFLOW_FORMS}")
    return Path(path)


def _directory(path: Path, what: str) -> MlflowTarget:
    """An SQLite store in a directory (what MLflow 3 recommends over its file store), artifacts beside it."""
    if path.exists() and not path.is_dir():
        raise SearchError(f"{what}: {str(path)!r} is not a directory")
    db = check_writable_file(path / "mlflow.db", what).absolute()
    return MlflowTarget(f"sqlite:///{db}", (db.parent / "artifacts").as_uri(), str(path))


def _server(value: str, what: str) -> MlflowTarget:
    """A tracking server's URL: a host, a valid port, no query or fragment; the password masked when shown."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise SearchError(f"{what}: the port is not a number in 0..65535") from None
    if not parts.hostname or parts.query or parts.fragment or " " in value:
        raise SearchError(f"{what}: a tracking server URL is http(s)://HOST[:PORT][/PATH], without query or "
                          "fragment")
    shown = value.replace(f":{parts.password}@", ":***@") if parts.password else value
    return MlflowTarget(value, None, shown)


def _key(name: str) -> str:
    """``name`` as an MLflow param or metric name (allowed characters, no path tricks, at most 250)."""
    key = _BAD_KEY.sub("_", str(name))[:250] or "_"
    return "_" + key[1:] if key.startswith(".") or posixpath.normpath(key) != key else key


def _ms(when: Any) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


class MlflowTrialLog:
    """An Optuna callback writing each finished trial of ``search`` as an MLflow run; a context manager
    around the optimisation: entering opens the experiment and parent run and logs finished trials MLflow
    does not hold yet (a crash, a killed worker, a study searched before with mlflow off); leaving logs the
    trial an exception failed (Optuna calls no callback for it) and ends the parent run."""

    def __init__(self, search: Any, study: optuna.Study, target: MlflowTarget, objectives: list[str],
                 baseline: dict[str, float]) -> None:
        self.search, self.study = search, study
        self.target = target
        self.objectives = list(objectives)
        self.baseline = baseline
        self.client: Any = None
        self.parent = ""
        self.broken = False  # a write failed: the rest of this run logs nothing (the next run catches up)

    # -- context --------------------------------------------------------------------------------------
    def __enter__(self) -> list[MlflowTrialLog]:
        self.client = self._open_client()
        self.experiment = self._experiment()
        self.parent = self._parent_run()
        self.catch_up()
        return [self]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.broken:  # the store failed once in this run: no more waiting on it; the next run catches up
            return
        self.catch_up()
        status = "FINISHED" if kind is None else "KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED"
        self._safely("end the study's run", lambda: self.client.set_terminated(self.parent, status=status))

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if not self.broken:
            self._safely(f"log trial {trial.number}", lambda: self.log_trial(trial))

    # -- MLflow ---------------------------------------------------------------------------------------
    def _open_client(self) -> Any:
        """The client of the target; MLflow's SQLite models warn SQLAlchemy 2.1's deprecation of ``noload`` when
        first imported, a warning for MLflow's authors that fxforge's users can do nothing about."""
        if self.target.uri.lower().startswith(("http://", "https://")):
            self._probe_server()
        # MLflow 3 sends usage telemetry to its authors by default: a search logging its trials does not opt its
        # user in. Set MLFLOW_DISABLE_TELEMETRY=false to allow it.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"The ``noload`` loader strategy is deprecated")
                from mlflow.tracking import MlflowClient

                client = MlflowClient(tracking_uri=self.target.uri)
                client.search_experiments(max_results=1)  # opens (creates) the store or reaches the server now
                return client
        except ImportError as exc:
            raise SearchError(f"mlflow logging needs the mlflow-skinny package ({exc})") from None
        except Exception as exc:  # MlflowException, a connection error: one message naming the target
            raise SearchError(f"mlflow {self.target.shown!r}: cannot open the tracking store: "
                              f"{str(exc).splitlines()[0][:400]}") from None

    def _probe_server(self) -> None:
        """Refuse a tracking server that accepts no connection within 10 s (MLflow's client retries a refused
        connection for about four minutes before it gives up)."""
        import socket

        parts = urlsplit(self.target.uri)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        try:
            socket.create_connection((parts.hostname or "", port), timeout=10).close()
        except OSError as exc:
            raise SearchError(f"mlflow {self.target.shown!r}: cannot reach the tracking server ({exc})") from None

    def _experiment(self) -> str:
        """The id of the experiment named after the study, created if needed; a deleted one is refused."""
        name = self.study.study_name
        found = self.client.get_experiment_by_name(name)
        if found is None:
            return str(self.client.create_experiment(name, artifact_location=self.target.artifacts))
        if found.lifecycle_stage != "active":
            raise SearchError(f"mlflow {self.target.shown!r}: experiment {name!r} is deleted; restore it "
                              "(mlflow experiments restore) or choose another study_name")
        return str(found.experiment_id)

    def _runs(self, role: str) -> Iterator[Any]:
        """The experiment's runs fxforge made in ``role`` ("study" or "trial"), page by page."""
        token = None
        while True:
            page = self.client.search_runs([self.experiment], f"tags.`{_ROLE}` = '{role}'", max_results=1000,
                                           page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def _parent_run(self) -> str:
        """The study's run (found again on resume, by another worker too), marked running, with its settings."""
        search = self.search
        found = next(self._runs("study"), None)
        if found is None:
            run_id: str = self.client.create_run(self.experiment, run_name=self.study.study_name,
                                                 tags={_ROLE: "study", _STUDY: self.study.study_name}).info.run_id
        else:
            run_id = found.info.run_id
            self.client.update_run(run_id, status="RUNNING")
        from mlflow.entities import Metric, RunTag

        settings = {"objectives": ",".join(self.objectives), "sampler": search.sampler, "pruner": search.pruner,
                    "seed": search.seed, "n_trials": search.n_trials, "space": search.space.kind,
                    "constraints": "; ".join(repr(c) for c in search.constraints)}
        tags = [RunTag(f"fxforge.{k}", str(v)[:8000]) for k, v in settings.items()]
        now = _ms(_now())
        metrics = [Metric(_key(f"baseline_{k}"), float(v), now or 0, 0) for k, v in self.baseline.items()]
        self.client.log_batch(run_id, metrics=metrics, tags=tags)
        return run_id

    def catch_up(self) -> None:
        """Log each finished trial of the study that has no run in the experiment yet."""
        from optuna.trial import TrialState

        def missing() -> None:
            held = {r.data.tags.get(_TRIAL) for r in self._runs("trial")}
            for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                       TrialState.FAIL)):
                if str(trial.number) not in held:
                    self.log_trial(trial)

        self._safely("log the finished trials it does not hold", missing)

    def log_trial(self, trial: optuna.trial.FrozenTrial) -> str:
        """One run for ``trial``: its parameters, objective values, constraints, intermediate values, timing,
        plan key, cache source and state (run status FINISHED, KILLED for pruned, FAILED); returns its id."""
        from mlflow.entities import Metric, Param

        from .runner import trial_plan_key, trial_result

        state = trial.state.name
        end = _ms(trial.datetime_complete) or _ms(_now()) or 0
        result = trial_result(trial)
        tags = {_ROLE: "trial", _TRIAL: str(trial.number), _STUDY: self.study.study_name,
                "fxforge.state": state, "mlflow.parentRunId": self.parent}
        if trial_plan_key(trial) is not None:
            tags["fxforge.plan_key"] = str(trial_plan_key(trial))
        if "cached_from" in result:
            tags["fxforge.cached_from"] = str(result["cached_from"])
        if result.get("notes"):
            tags["fxforge.notes"] = json.dumps(result["notes"], sort_keys=True, default=str)[:8000]
        run = self.client.create_run(self.experiment, start_time=_ms(trial.datetime_start) or end,
                                     tags=tags, run_name=f"trial-{trial.number}")
        run_id: str = run.info.run_id
        params, seen = [], set()
        for name, value in trial.params.items():
            key = _key(name)
            while key in seen:  # two names made equal by _key: keep both
                key = key[:245] + "~"
            seen.add(key)
            params.append(Param(key, str(value)[:6000]))
        metrics = [Metric("trial_number", float(trial.number), end, 0)]
        values = trial.values if trial.state.name == "COMPLETE" else None
        if values is not None:
            metrics += [Metric(_key(n), float(v), end, 0) for n, v in zip(self.objectives, values, strict=False)]
        violations = result.get("constraints", [])
        for c, v in zip(self.search.constraints, violations, strict=False):
            metrics.append(Metric(_key(f"constraint_{c.objective}"), float(v), end, 0))
        if violations:
            metrics.append(Metric("feasible", float(all(v <= 0 for v in violations)), end, 0))
        for part, seconds in result.get("timing_s", {}).items():
            metrics.append(Metric(_key(f"timing_s_{part}"), float(seconds), end, 0))
        for step, value in sorted(trial.intermediate_values.items()):
            if not math.isnan(value):
                metrics.append(Metric("intermediate", float(value), end, int(step)))
        for i in range(0, max(len(params), len(metrics), 1), 100):  # MLflow takes 100 params per batch
            self.client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
        self.client.set_terminated(run_id, status=_STATUS.get(state, "FAILED"), end_time=end)
        return run_id

    def _safely(self, doing: str, act: Any) -> None:
        """Run ``act``; a failure is a warning (the study holds the results; the next run logs what is missing)."""
        try:
            act()
        except Exception as exc:  # a server gone away, a full disk: the search goes on
            self.broken = True
            _log.warning("mlflow %s: could not %s (%s); no more runs are logged until the study's next run, "
                         "which logs what is missing", self.target.shown,
                         doing, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)


def _now() -> Any:
    from datetime import datetime

    return datetime.now()

