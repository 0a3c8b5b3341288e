"""Search fixtures: a throw-away PostgreSQL on 127.0.0.1 (started here, stopped at the end)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fxforge.search import LocalPostgres, postgres_available


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    reason = postgres_available()
    if reason:
        pytest.skip(f"no PostgreSQL server binaries on this machine ({reason})")
    with LocalPostgres() as pg:
        yield pg.url
