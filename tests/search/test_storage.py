"""Study storage: embedded journal by default, clear errors for unreachable databases, real PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest

from fxforge.search import SearchError, StorageSpec
from fxforge.search.storage import open_storage


def test_unreachable_and_unknown_storage_are_one_line_errors(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(SearchError, match=r"cannot open study storage 127\.0\.0\.1:1/nothing: .*") as err:
        open_storage(StorageSpec("postgresql://postgres@127.0.0.1:1/nothing"), tmp_path)
    assert "\n" not in str(err.value) and time.perf_counter() - start < 30
    with pytest.raises(SearchError, match="scheme 'redis' not supported"):
        open_storage(StorageSpec("redis://127.0.0.1:6379"), tmp_path)


def test_journal_is_the_default_and_persists(tmp_path: Path) -> None:
    storage = open_storage(StorageSpec(), tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert (tmp_path / "study.journal").is_file()
    again = optuna.load_study(study_name="s", storage=open_storage(StorageSpec(), tmp_path))
    assert len(again.trials) == 3


def test_postgres_storage_heartbeat_configured(postgres_url: str, tmp_path: Path) -> None:
    storage = open_storage(StorageSpec(postgres_url), tmp_path)
    assert storage.get_heartbeat_interval() == 2
    study = optuna.create_study(storage=storage, study_name="pg")
    study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=2)
    assert len(optuna.load_study(study_name="pg", storage=postgres_url.replace("+psycopg", "+psycopg")).trials) == 2
