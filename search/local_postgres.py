"""A throw-away PostgreSQL server on 127.0.0.1 for scale-out runs on one machine, tests and benchmarks.

``with LocalPostgres() as pg: storage = pg.url`` creates a data directory, runs ``initdb`` and
``pg_ctl start`` (as the ``postgres`` user when running as root: PostgreSQL refuses root), listens on
127.0.0.1 only (never another address) and stops the server and removes the directory on exit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from .errors import SearchError

__all__ = ["LocalPostgres", "postgres_available"]


def postgres_available() -> str | None:
    """None when initdb/pg_ctl are on PATH, else the reason they cannot be used."""
    missing = [b for b in ("initdb", "pg_ctl") if shutil.which(b) is None]
    return f"PostgreSQL binaries not on PATH: {missing}" if missing else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalPostgres:
    """Start a private PostgreSQL 127.0.0.1 server; ``url`` is an SQLAlchemy URL for Optuna's RDBStorage."""

    def __init__(self, database: str = "fxforge", max_connections: int = 100) -> None:
        self.database = database
        self.max_connections = max_connections
        self.port = 0
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *cmd: str) -> None:
        as_root = os.geteuid() == 0
        full = ["runuser", "-u", "postgres", "--", *cmd] if as_root else list(cmd)
        done = subprocess.run(full, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise SearchError(f"{' '.join(cmd[:2])} failed: {(done.stderr or done.stdout).strip()[-400:]}")

    def start(self) -> LocalPostgres:
        reason = postgres_available()
        if reason:
            raise SearchError(reason)
        self.dir = Path(tempfile.mkdtemp(prefix="fxforge-pg-"))
        data = self.dir / "data"
        data.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            shutil.chown(data, "postgres")
        self._run("initdb", "-D", str(data), "--auth=trust", "-U", "postgres")
        self.port = _free_port()
        self._run("pg_ctl", "-D", str(data), "-o", self._options(), "-l", str(self.dir / "log"), "-w", "start")
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c",
                  f"CREATE DATABASE {self.database}")
        return self

    def _options(self) -> str:
        return (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                f"-c max_connections={self.max_connections} -c fsync=off")

    def restart(self) -> None:
        """Stop and start the server on the same port and data (every open connection is cut)."""
        if self.dir is None:
            raise SearchError("the server is not running")
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-o", self._options(), "-l", str(self.dir / "log"),
                  "-w", "-m", "fast", "restart")

    def stop(self) -> None:
        if self.dir is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-w", "stop", "-m", "fast")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
