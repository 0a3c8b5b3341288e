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


def _sample(trial: optuna.Trial) -> None:
    trial.suggest_int("layers", 1, 6)
    trial.suggest_float("lr", 1e-5, 1e-2, log=True)
    for i in range(3):
        trial.suggest_categorical(f"bits_{i}", [2, 4, 8])


@pytest.mark.parametrize("kind", ["postgresql", "sqlite", "journal"])
def test_batched_params_store_exactly_what_optuna_stores(kind: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """Parameters sampled inside batched_params reach the storage with the same values and distributions as
    Optuna's one-by-one writes (the journal: in one append; databases: Optuna's own writes); a study re-read
    from the storage shows them; an incompatible distribution is still refused; sampling that raises keeps
    what it sampled."""
    from fxforge.search.storage import batched_params

    url = {"postgresql": lambda: request.getfixturevalue("postgres_url"),
           "sqlite": lambda: f"sqlite:///{tmp_path / 'db.sqlite'}", "journal": lambda: None}[kind]()

    def run(name: str, batched: bool) -> list[optuna.trial.FrozenTrial]:
        study = optuna.create_study(storage=open_storage(StorageSpec(url), tmp_path), study_name=name,
                                    sampler=optuna.samplers.RandomSampler(seed=3))

        def objective(trial: optuna.Trial) -> float:
            if batched:
                with batched_params(trial):
                    _sample(trial)
                    trial.set_user_attr("plan", {"layers": trial.params["layers"]})
            else:
                _sample(trial)
                trial.set_user_attr("plan", {"layers": trial.params["layers"]})
            return float(trial.params["layers"])

        study.optimize(objective, n_trials=3)
        return optuna.load_study(study_name=name, storage=open_storage(StorageSpec(url), tmp_path)).trials

    plain, batched = run(f"plain-{kind}", False), run(f"batched-{kind}", True)
    assert [t.params for t in batched] == [t.params for t in plain]
    assert [t.distributions for t in batched] == [t.distributions for t in plain]
    assert [t.user_attrs for t in batched] == [t.user_attrs for t in plain] != [{}] * 3
    assert len(batched[0].params) == 5

    storage = open_storage(StorageSpec(url), tmp_path)
    study = optuna.load_study(study_name=f"batched-{kind}", storage=storage)
    if kind == "journal":  # the five parameters and the attribute are appended (and fsynced) once (Optuna: six)
        backend = storage.buffered.inner
        appends: list[int] = []
        append = backend.append_logs
        backend.append_logs = lambda logs: (appends.append(len(logs)), append(logs))[1]
        trial = study.ask()
        with batched_params(trial):
            _sample(trial)
            trial.set_user_attr("plan", {"n": 1})
            assert appends[1:] == []  # appends[0]: the trial's creation; nothing else written yet
        backend.append_logs = append
        assert appends[1:] == [6] and len(trial.params) == 5
        assert study.trials[-1].params == trial.params  # the writing storage replayed its own records
        again = optuna.load_study(study_name=f"batched-{kind}", storage=open_storage(StorageSpec(url), tmp_path))
        assert again.trials[-1].params == trial.params and again.trials[-1].user_attrs == {"plan": {"n": 1}}
    trial = study.ask()
    with pytest.raises(ValueError, match="does not support dynamic value space"):
        with batched_params(trial):
            trial.suggest_int("layers", 1, 6)
            trial.suggest_float("layers_2", 0, 1)
            trial.suggest_categorical("bits_0", [3, 5])
    trial = study.ask()
    with pytest.raises(optuna.TrialPruned):
        with batched_params(trial):
            trial.suggest_int("layers", 1, 6)
            raise optuna.TrialPruned("invalid combination")
    stored = optuna.load_study(study_name=f"batched-{kind}", storage=open_storage(StorageSpec(url), tmp_path))
    assert "layers" in stored.trials[-1].params


def test_search_storage_uses_no_private_optuna_module() -> None:
    """search/storage.py batches through Optuna's public journal-backend interface only: no ``optuna.*._x``
    import and no ``._x`` attribute of an Optuna object (an upgrade cannot silently change what it does)."""
    import ast

    import fxforge.search.storage as module

    tree = ast.parse(Path(module.__file__).read_text())
    imports = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imports += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imports if m.startswith("optuna") and any(p.startswith("_") for p in m.split("."))]
    private = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                      and not n.attr.startswith("__")})
    assert private == [], private


def test_postgres_workers_survive_a_server_restart(tmp_path: Path) -> None:
    """A pooled connection idle past ``ping_after_idle`` is checked before reuse, so a study keeps going
    after the server restarted between trials (without the check the next write fails on a dead socket)."""
    from fxforge.search import LocalPostgres

    with LocalPostgres() as pg:
        spec = StorageSpec(pg.url, ping_after_idle=0.5)
        study = optuna.create_study(storage=open_storage(spec, tmp_path), study_name="restart")
        study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=2)
        pg.restart()
        time.sleep(1.0)
        study.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=2)
        assert [t.state for t in optuna.load_study(study_name="restart", storage=pg.url).trials] == [
            optuna.trial.TrialState.COMPLETE] * 4

        unchecked = optuna.create_study(storage=open_storage(StorageSpec(pg.url, ping_after_idle=3600), tmp_path),
                                        study_name="unchecked")
        unchecked.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=1)
        pg.restart()
        import sqlalchemy

        with pytest.raises((optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError)):
            unchecked.optimize(lambda t: t.suggest_int("x", 0, 3), n_trials=1)
