"""Where a study lives: an embedded journal file by default, SQLite, or PostgreSQL for many workers.

Embedded (a path or None): Optuna's journal file under the run directory — append-only, so a search
killed with Ctrl-C or SIGKILL loses no finished trial and resumes (its one writer fails what a killed run
left RUNNING). ``sqlite:///…`` and ``postgresql://…`` use Optuna's RDBStorage; every worker sends a
heartbeat, and a trial whose worker died (no heartbeat for ``grace_period`` s) is marked failed — by the
next trial any worker starts, or by a resume — and re-queued with the same parameters by
:class:`optuna.storages.RetryHeartbeatStaleTrialCallback`, so another worker (or the resumed run) finishes it.
Both kinds are what ``optuna-dashboard`` reads (``optuna-dashboard <journal file or URL>``).
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend

from .errors import SearchError
from .paths import check_writable_file

__all__ = ["BufferedJournalBackend", "BufferedJournalStorage", "StorageSpec", "batched_params", "fail_stale_trials",
           "open_storage"]

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

    def __post_init__(self) -> None:
        """Refuse a malformed URL or setting here, before anything is opened or created."""
        for name in ("heartbeat_interval", "grace_period", "max_retry"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SearchError(f"storage {name} must be a positive integer, got {value!r}")
        if isinstance(self.ping_after_idle, bool) or not isinstance(self.ping_after_idle, int | float) \
                or not self.ping_after_idle >= 0:
            raise SearchError(f"storage ping_after_idle must be a number >= 0, got {self.ping_after_idle!r}")
        if self.url is None:
            return
        if not isinstance(self.url, str) or not self.url.strip():
            raise SearchError(f"storage must be a journal file path or a database URL, got {self.url!r}")
        if self.kind == "journal" and _LOOKS_LIKE_URL.match(self.url):  # sqlite:/x.db, sqlite//x.db, postgresql:h
            raise SearchError(f"storage {self.url!r} is a malformed database URL (it would be taken as a journal "
                              f"file path); {_URL_FORMS}")
        if self.kind == "sqlite":
            path = self.url.split("://", 1)[1].split("?", 1)[0]
            if not path.startswith("/") or path in ("/", "//") or path.endswith("/"):
                raise SearchError(f"storage {self.url!r}: an SQLite URL names a file after three slashes; {_URL_FORMS}")

    @property
    def kind(self) -> str:
        if self.url is None or "://" not in self.url:
            return "journal"
        scheme = self.url.split("://", 1)[0].split("+", 1)[0]
        if scheme not in ("sqlite", "postgresql"):
            raise SearchError(f"storage {self.url!r}: scheme {scheme!r} not supported; {_URL_FORMS}")
        return scheme

    def file(self, run_dir: Path) -> Path | None:
        """The file the study is kept in (journal or SQLite), None for a server (or SQLite in memory)."""
        if self.kind == "journal":
            return Path(self.url) if self.url else run_dir / JOURNAL_NAME
        if self.kind == "sqlite":
            path = str(self.url).split("://", 1)[1].split("?", 1)[0][1:]
            return None if path == ":memory:" else Path(path)
        return None

    def check_file(self, run_dir: Path) -> None:
        """Refuse, before anything is created, a storage file that is a directory or cannot be created (a
        parent that is a file, or a directory not writable)."""
        path = self.file(run_dir)
        if path is not None:
            check_writable_file(path, f"storage {self.url!r}: file" if self.url else "journal storage")


_URL_FORMS = "use a path (journal file), sqlite:///FILE or postgresql://USER@HOST:PORT/DB"
# A scheme and a colon, or a database scheme followed by slashes, without the '://' of a URL.
_LOOKS_LIKE_URL = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]*:|(?:sqlite|postgres(?:ql)?)(?:\+\w+)?//)")


def _sqlalchemy_url(url: str) -> str:
    """postgresql:// → postgresql+psycopg:// (psycopg 3 is the driver fxforge installs)."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def _retry_callback(max_retry: int) -> RetryHeartbeatStaleTrialCallback:
    """Optuna's stale-trial retry callback, without the ExperimentalWarning its constructor raises on every study
    a user opens (fxforge, not the user, chose it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback(max_retry=max_retry)


def open_storage(spec: StorageSpec, run_dir: Path) -> optuna.storages.BaseStorage:
    """Open (creating if needed) the storage; an unreachable database is one clear SearchError."""
    kind = spec.kind
    spec.check_file(run_dir)
    path = spec.file(run_dir)
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "journal":
            return BufferedJournalStorage(str(path))
    except OSError as exc:  # e.g. a read-only file system
        raise SearchError(f"cannot open study storage {str(path)!r}: {exc.strerror or exc}") from None
    url = _sqlalchemy_url(str(spec.url))
    kwargs: dict[str, Any] = {  # RDBStorage's heartbeat arguments (int, int, callback), on every database
        "heartbeat_interval": spec.heartbeat_interval, "grace_period": spec.grace_period,
        "heartbeat_stale_trial_callback": _retry_callback(spec.max_retry)}
    engine = {"connect_args": {"connect_timeout": 5}} if kind == "postgresql" else {}
    try:
        with warnings.catch_warnings():  # heartbeats are Optuna-experimental: fxforge's choice, not the user's
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = RDBStorage(url, engine_kwargs=engine, **kwargs)
        if kind == "postgresql":
            _ping_after_idle(storage.engine, spec.ping_after_idle)
        return storage
    except Exception as exc:  # sqlalchemy's OperationalError and friends: one line, not a traceback
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        safe = url.split("@")[-1] if "@" in url else url
        raise SearchError(f"cannot open study storage {safe}: {reason}") from None


def fail_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage, spec: StorageSpec) -> None:
    """Fail the trials a dead process left RUNNING, when a study is resumed, and re-queue each with its
    parameters (at most ``spec.max_retry`` times), the same on every storage. Journal: every RUNNING trial
    (the embedded store has one writer at a time). Databases: those whose heartbeat is older than the grace
    period, re-queued by the storage's retry callback (live workers' trials keep running)."""
    if spec.kind != "journal":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # Optuna calls it per trial too
            optuna.storages.fail_stale_trials(study)
        return
    retry = _retry_callback(spec.max_retry)
    study_id = storage.get_study_id_from_name(study.study_name)  # public BaseStorage methods only
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
        retry(study, storage.get_trial(trial_id))


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


class _Pending(threading.local):
    """Per thread: the journal writes held back inside :func:`batched_params` (None outside it)."""

    logs: dict[BufferedJournalBackend, list[dict[str, Any]]] | None = None


_PENDING = _Pending()


class BufferedJournalBackend(BaseJournalBackend):
    """A journal backend (Optuna's public ``BaseJournalBackend`` interface) around the journal file that
    holds back the records a thread appends inside :func:`batched_params` and appends them at its end in
    one write (one fsync instead of one per parameter); every other append and every read goes straight
    to the file."""

    def __init__(self, inner: BaseJournalBackend) -> None:
        self.inner = inner
        self.storage: JournalStorage | None = None  # the storage reading this journal, synced after a flush

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        return self.inner.read_logs(log_number_from)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        pending = _PENDING.logs
        if pending is None:
            self.inner.append_logs(logs)
        else:
            pending.setdefault(self, []).extend(logs)

    def flush(self, logs: list[dict[str, Any]]) -> None:
        """Append held-back records in one write, then let the storage replay them (a public read syncs it)."""
        self.inner.append_logs(logs)
        if self.storage is not None:
            self.storage.get_all_studies()


class BufferedJournalStorage(JournalStorage):
    """Optuna's JournalStorage over a :class:`BufferedJournalBackend` (what ``open_storage`` returns for
    a journal file); only public Optuna API is used, so an Optuna upgrade cannot silently change it."""

    def __init__(self, path: str) -> None:
        self.buffered = BufferedJournalBackend(JournalFileBackend(path))
        super().__init__(self.buffered)
        self.buffered.storage = self


@contextmanager
def batched_params(trial: optuna.Trial | None = None) -> Iterator[None]:
    """Within the block the journal records this thread writes (``trial``'s sampled parameters and user
    attributes) are held back and appended together when it ends, also when sampling raises (e.g. an
    invalid combination pruned before training), so they are stored before any of the trial's work starts
    and a trial re-queued after a crash has them. The journal then replays them as Optuna replays its own
    writes (a distribution incompatible with the study's is refused here, as a one-by-one write is).

    Database storages (SQLite, PostgreSQL) get Optuna's own writes, one transaction per parameter:
    batching those would need Optuna's private RDB models, and benchmarks/bench_search.py measures what
    the per-parameter transactions cost."""
    if _PENDING.logs is not None:  # nested: the outer block writes
        yield
        return
    _PENDING.logs = {}
    try:
        yield
    finally:
        pending, _PENDING.logs = _PENDING.logs, None
        for backend, logs in pending.items():
            backend.flush(logs)
