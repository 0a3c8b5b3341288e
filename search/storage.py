"""Where a study lives: an embedded journal file by default, SQLite, or PostgreSQL for many workers.

Embedded (a path or None): Optuna's journal file under the run directory — append-only, so a search
killed with Ctrl-C or SIGKILL loses no finished trial and resumes. ``sqlite:///…`` and
``postgresql://…`` use Optuna's RDBStorage; for PostgreSQL every worker sends a heartbeat, and a trial
whose worker died (no heartbeat for ``grace_period`` s) is marked failed and re-queued with the same
parameters by :class:`optuna.storages.RetryHeartbeatStaleTrialCallback`, so another worker finishes it.
Both kinds are what ``optuna-dashboard`` reads (``optuna-dashboard <journal file or URL>``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend

from .errors import SearchError

__all__ = ["StorageSpec", "open_storage", "batched_params"]

JOURNAL_NAME = "study.journal"


@dataclass(frozen=True)
class StorageSpec:
    """How to reach a study's storage; ``heartbeat_interval``/``grace_period`` apply to databases;
    a pooled PostgreSQL connection idle for more than ``ping_after_idle`` s is checked before reuse."""

    url: str | None = None
    heartbeat_interval: int = 2
    grace_period: int = 8
    max_retry: int = 3
    ping_after_idle: float = 5.0

    @property
    def kind(self) -> str:
        if self.url is None or "://" not in self.url:
            return "journal"
        scheme = self.url.split("://", 1)[0].split("+", 1)[0]
        if scheme not in ("sqlite", "postgresql"):
            raise SearchError(f"storage {self.url!r}: scheme {scheme!r} not supported; use a path (journal file), "
                              "sqlite:///FILE or postgresql://USER@HOST:PORT/DB")
        return scheme


def _sqlalchemy_url(url: str) -> str:
    """postgresql:// → postgresql+psycopg:// (psycopg 3 is the driver fxforge installs)."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def open_storage(spec: StorageSpec, run_dir: Path) -> optuna.storages.BaseStorage:
    """Open (creating if needed) the storage; an unreachable database is one clear SearchError."""
    kind = spec.kind
    if kind == "journal":
        path = Path(spec.url) if spec.url else run_dir / JOURNAL_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path)))
    url = _sqlalchemy_url(str(spec.url))
    kwargs: dict[str, object] = {}
    if kind == "postgresql":
        kwargs = {"heartbeat_interval": spec.heartbeat_interval, "grace_period": spec.grace_period,
                  "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=spec.max_retry)}
        engine = {"connect_args": {"connect_timeout": 5}}
    else:
        engine = {}
    try:
        storage = RDBStorage(url, engine_kwargs=engine, **kwargs)  # type: ignore[arg-type]
        if kind == "postgresql":
            _ping_after_idle(storage.engine, spec.ping_after_idle)
        return storage
    except Exception as exc:  # sqlalchemy's OperationalError and friends: one line, not a traceback
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        safe = url.split("@")[-1] if "@" in url else url
        raise SearchError(f"cannot open study storage {safe}: {reason}") from None


def _ping_after_idle(engine: Any, idle_s: float) -> None:
    """Check a pooled connection before reuse only when it sat idle for ``idle_s`` (a server restart or a
    dropped connection during a long trial): a dead one is replaced, as with SQLAlchemy's ``pool_pre_ping``.
    pre_ping itself checks every checkout, and a trial's writes come in bursts of ten or so checkouts a few
    milliseconds apart; with 8 workers on 2 cores those pings cost 4% of the search's throughput."""
    import sqlalchemy

    def checkin(dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop("idle_since", None)
        if since is not None and time.monotonic() - since > idle_s:
            try:
                alive = engine.dialect.do_ping(dbapi_connection)
            except Exception as exc:  # the driver's own disconnect error: let the pool reconnect
                raise sqlalchemy.exc.DisconnectionError(str(exc)) from exc
            if not alive:
                raise sqlalchemy.exc.DisconnectionError("connection failed its liveness check")

    sqlalchemy.event.listen(engine, "checkin", checkin)
    sqlalchemy.event.listen(engine, "checkout", checkout)


class _ParamBuffer:
    """Stands in for a trial's storage while it samples: parameter and user-attribute writes are
    collected, everything else passes through."""

    def __init__(self, storage: optuna.storages.BaseStorage) -> None:
        self._storage = storage
        self.pending: list[tuple[int, str, float, optuna.distributions.BaseDistribution]] = []
        self.attrs: list[tuple[int, str, Any]] = []

    def set_trial_param(self, trial_id: int, name: str, value: float,
                        distribution: optuna.distributions.BaseDistribution) -> None:
        self.pending.append((trial_id, name, value, distribution))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.attrs.append((trial_id, key, value))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


def _write_batch(storage: optuna.storages.BaseStorage, pending: list[Any], attrs: list[Any]) -> None:
    """A trial's parameters (and user attributes) in one write where the storage allows it: Optuna's RDB
    storage otherwise commits each in its own transaction (16 parameters: 16 transactions and a re-read of
    the trial row for each, the largest per-trial cost on PostgreSQL), and its journal appends and fsyncs
    each as its own record. Any other storage (or an Optuna whose internals differ) gets the writes one
    by one, as Optuna makes them."""
    if len({trial_id for trial_id, *_ in [*pending, *attrs]}) == 1 and (
            _write_rdb(storage, pending, attrs) or _write_journal(storage, pending, attrs)):
        return
    for trial_id, name, value, dist in pending:
        storage.set_trial_param(trial_id, name, value, dist)
    for trial_id, key, value in attrs:
        storage.set_trial_user_attr(trial_id, key, value)


def _write_journal(storage: optuna.storages.BaseStorage, pending: list[Any], attrs: list[Any]) -> bool:
    """Optuna's journal records for the batch, appended with one fsync, then replayed as Optuna replays its
    own (which refuses a distribution incompatible with the study's, as one-by-one writes do)."""
    try:
        from optuna.storages.journal._storage import JournalOperation
    except ImportError:  # pragma: no cover - a future Optuna
        return False
    if not isinstance(storage, JournalStorage) or not all(
            hasattr(storage, a) for a in ("_backend", "_replay_result", "_thread_lock", "_sync_with_backend")):
        return False
    with storage._thread_lock:
        worker = storage._replay_result.worker_id
        logs: list[dict[str, Any]] = [
            {"op_code": JournalOperation.SET_TRIAL_PARAM, "worker_id": worker, "trial_id": trial_id,
             "param_name": name, "param_value_internal": value,
             "distribution": optuna.distributions.distribution_to_json(dist)}
            for trial_id, name, value, dist in pending]
        logs += [{"op_code": JournalOperation.SET_TRIAL_USER_ATTR, "worker_id": worker, "trial_id": trial_id,
                  "user_attr": {key: value}} for trial_id, key, value in attrs]
        storage._backend.append_logs(logs)
        storage._sync_with_backend()
    return True


def _write_rdb(storage: optuna.storages.BaseStorage, pending: list[Any], attrs: list[Any]) -> bool:
    """One database transaction through Optuna's own per-row writers and models (its cached RDB storage)."""
    backend = getattr(storage, "_backend", None)
    studies = getattr(storage, "_studies", None)
    ids = getattr(storage, "_trial_id_to_study_id_and_number", None)
    lock = getattr(storage, "_lock", None)
    try:
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session
    except ImportError:  # pragma: no cover - a future Optuna
        return False
    if (not isinstance(backend, RDBStorage) or studies is None or ids is None or lock is None
            or not hasattr(backend, "_set_trial_param_without_commit")
            or not hasattr(backend, "_set_trial_attr_without_commit")):
        return False
    trial_id = [*pending, *attrs][0][0]
    with lock:
        known = studies[ids[trial_id][0]].param_distribution
        with _create_scoped_session(backend.scoped_session, True) as session:
            row = models.TrialModel.find_or_raise_by_id(trial_id, session)
            backend.check_trial_is_updatable(trial_id, row.state)
            fresh = []
            for _, name, value, dist in pending:
                if known.get(name) is None:  # first sight of this name here: Optuna's own check against the study
                    backend._set_trial_param_without_commit(session, trial_id, name, value, dist, None)
                    continue
                optuna.distributions.check_distribution_compatibility(known[name], dist)
                fresh.append(models.TrialParamModel(trial_id=trial_id, param_name=name, param_value=value,
                                                    distribution_json=optuna.distributions.distribution_to_json(dist)))
            session.add_all(fresh)
            for _, key, value in attrs:
                backend._set_trial_attr_without_commit(session, models.TrialUserAttributeModel, trial_id, key, value)
        for _, name, _, dist in pending:
            known.setdefault(name, dist)
    return True


@contextmanager
def batched_params(trial: optuna.Trial) -> Iterator[None]:
    """Within the block the trial's sampled parameters and user attributes are buffered and written
    together when it ends (also when sampling raises, e.g. an invalid combination pruned before training),
    so they are stored before any of the trial's work starts and a trial re-queued after a crash has them."""
    storage = trial.storage
    buffer = _ParamBuffer(storage)
    trial.storage = buffer  # type: ignore[assignment]
    try:
        yield
    finally:
        trial.storage = storage
        if buffer.pending or buffer.attrs:
            _write_batch(storage, buffer.pending, buffer.attrs)
