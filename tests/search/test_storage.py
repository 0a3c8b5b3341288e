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


def _private_uses(path: Path) -> list[str]:
    """Private names a module reaches for: ``optuna.*._x`` imports, ``_x`` names imported from optuna, ``._x``
    attributes of anything but ``self``/``cls`` and ``getattr``-style calls with a ``"_x"`` name (dunders
    excepted). fxforge reads its own private attributes only on ``self``, so any other is a dependency's."""
    import ast

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("optuna"):
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if private(a.name) or any(private(p) for p in node.module.split("."))]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.startswith("optuna") and any(private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                private(node.args[1].value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_private_uses_are_found(tmp_path: Path) -> None:
    """_private_uses finds each kind of private reach (else the package scan's empty result proves nothing)."""
    path = tmp_path / "module.py"
    path.write_text("from optuna.storages._rdb import models\nfrom optuna.trial import _state\n"
                    "import optuna._imports\nstudy._storage.set(t._trial_id)\n"
                    "self._mine = getattr(study, '_storage')\ncls._also = obj.__dict__\n")
    found = _private_uses(path)
    assert sorted(found) == sorted(["from optuna.storages._rdb import models", "from optuna.trial import _state",
                                    "import optuna._imports", "line 4: study._storage", "line 4: t._trial_id",
                                    "line 5: getattr(study, '_storage')"])


def test_search_package_uses_no_private_optuna_api() -> None:
    """Every module of fxforge.search uses Optuna's public API only (storage batching through the public
    journal-backend interface, interrupted trials failed through BaseStorage's methods): no private module,
    name or attribute, so an Optuna upgrade cannot silently change what a search does."""
    import fxforge.search as package

    modules = sorted(Path(package.__file__).parent.glob("*.py"))
    assert len(modules) > 10
    found = {m.name: uses for m in modules if (uses := _private_uses(m))}
    assert found == {}, found


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
