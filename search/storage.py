"""Where a study lives: an embedded journal file by default, SQLite, or PostgreSQL for many workers.

Embedded (a path or None): Optuna's journal file under the run directory — append-only, so a search
killed with Ctrl-C or SIGKILL loses no finished trial and resumes. ``sqlite:///…`` and
``postgresql://…`` use Optuna's RDBStorage; for PostgreSQL every worker sends a heartbeat, and a trial
whose worker died (no heartbeat for ``grace_period`` s) is marked failed and re-queued with the same
parameters by :class:`optuna.storages.RetryHeartbeatStaleTrialCallback`, so another worker finishes it.
Both kinds are what ``optuna-dashboard`` reads (``optuna-dashboard <journal file or URL>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend

from .errors import SearchError

__all__ = ["StorageSpec", "open_storage"]

JOURNAL_NAME = "study.journal"


@dataclass(frozen=True)
class StorageSpec:
    """How to reach a study's storage; ``heartbeat_interval``/``grace_period`` apply to databases."""

    url: str | None = None
    heartbeat_interval: int = 2
    grace_period: int = 8
    max_retry: int = 3

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
        engine = {"pool_pre_ping": True, "connect_args": {"connect_timeout": 5}}
    else:
        engine = {}
    try:
        return RDBStorage(url, engine_kwargs=engine, **kwargs)  # type: ignore[arg-type]
    except Exception as exc:  # sqlalchemy's OperationalError and friends: one line, not a traceback
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        safe = url.split("@")[-1] if "@" in url else url
        raise SearchError(f"cannot open study storage {safe}: {reason}") from None
