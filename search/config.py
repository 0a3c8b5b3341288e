"""A search described as data (a TOML file or a dict): what ``fxforge search CONFIG.toml`` runs and
what a worker on another machine rebuilds from the study itself.

::

    [search]                      # study_name, n_trials, sampler, pruner, objectives, storage, run_dir, seed,
                                  # resume (default true: a rerun continues the study its config made),
                                  # mlflow (true or a tracking URI: one MLflow run per trial), prefix_cache
                                  # (default true: run_dir/prefix-cache; false, or a directory)
    study_name = "minilm-joint"
    objectives = ["accuracy", "avg_weight_bits"]
    [search.fidelity]             # rungs of growing budgets (search/fidelity.py): steps, eval_samples; e.g.
    steps = [50, 150, 450]        # with pruner = "successive_halving" and a single objective
    eval_samples = [100, 250, 500]
    [model]                       # a models.zoo name ("minilm", "tiny-bert", ...) or checkpoint = "path/to/ckpt"
    name = "minilm"
    hf_input_names = ["input_ids", "attention_mask", "labels"]
    [task]                        # TextClassificationTask keywords (dataset, train_size, eval_size, ...)
    eval_size = 200
    [space]                       # a space spec: kind = nas | precision | pruning | lora | joint
    kind = "precision"
    formats = { integer = { width = [4, 8], frac_width = [2, 4] } }
    [[constraints]]               # objective, max_drop / max_value / min_value
    objective = "accuracy"
    max_drop = 0.01
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna

from ..graph.output_paths import resolve_output_path
from ..graph.toml_file import load_toml_file
from .errors import SearchError
from .fidelity import Fidelity
from .mlflow_log import confine_local_target
from .objectives import Constraint, resolve_objectives
from .runner import CONFIG_ATTR, Search
from .space import space_from_spec
from .storage import StorageSpec, open_storage
from .task import TextClassificationTask

__all__ = ["CONFIG_ATTR", "check_resumable", "load_config", "search_from_config"]

_SECTIONS = ("search", "model", "task", "space", "constraints")
# Each key's type, checked before anything is built: (description, test).
_STR = ("a string", lambda v: isinstance(v, str))
_INT = ("an integer", lambda v: type(v) is int)
_NUM = ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
_BOOL = ("a bool", lambda v: isinstance(v, bool))
_STRS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
_TABLE = ("a table", lambda v: isinstance(v, dict))
_MLFLOW = ("true/false or a tracking URI string", lambda v: isinstance(v, bool | str))
_SEARCH_TYPES = {"study_name": _STR, "n_trials": _INT, "sampler": _STR, "pruner": _STR, "objectives": _STRS,
                 "storage": _STR, "run_dir": _STR, "seed": _INT, "worker": _INT, "resume": _BOOL, "timeout": _NUM,
                 "mlflow": _MLFLOW, "fidelity": _TABLE,
                 "prefix_cache": ("true/false or a directory", lambda v: isinstance(v, bool | str))}
_MODEL_TYPES = {"name": _STR, "checkpoint": _STR, "hf_input_names": _STRS, "num_labels": _INT}
_TASK_TYPES = {"dataset": _STR, "checkpoint": _STR, "train_size": _INT, "eval_size": _INT, "max_length": _INT,
               "train_args": _TABLE, "eval_batch_size": _INT, "report_every": _INT, "progress": _BOOL,
               "calibration_size": _INT}
_CONSTRAINT_TYPES = {"objective": _STR, "max_drop": _NUM, "max_value": _NUM, "min_value": _NUM}
_SEARCH_KEYS = tuple(_SEARCH_TYPES)
_MODEL_KEYS = tuple(_MODEL_TYPES)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a search TOML file through fxforge's one hardened TOML reader (graph/toml_file.py: a regular
    file of at most 1 MiB, strict UTF-8); SearchError naming the file (and the line of a syntax error)."""
    return load_toml_file(path, "search config", SearchError)


def _check(section: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    bad = sorted(set(given) - set(allowed))
    if bad:
        raise SearchError(f"[{section}]: unknown key(s) {bad}; allowed: {sorted(allowed)}")


def _typed(section: str, given: Any, types: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """``given`` as a dict after checking it is a table of known keys, each of its type (SearchError naming
    the section and key otherwise)."""
    if not isinstance(given, Mapping):
        raise SearchError(f"{section} must be a table, got {type(given).__name__}")
    _check(section.strip("[]"), given, tuple(types))
    for key, value in given.items():
        what, ok = types[key]
        if not ok(value):
            raise SearchError(f"{section} {key} must be {what}, got {type(value).__name__} {str(value)[:40]!r}")
    return dict(given)


def _constraints(given: Any) -> list[Constraint]:
    """The [[constraints]] array of tables, typed; each needs an objective."""
    if not isinstance(given, list):
        raise SearchError(f"constraints must be an array of tables ([[constraints]]), got {type(given).__name__}")
    out = []
    for i, entry in enumerate(given, 1):
        where = f"[[constraints]] entry {i}"
        if not isinstance(entry, Mapping):
            raise SearchError(f"{where} must be a table, got {type(entry).__name__}")
        _check("constraints", entry, tuple(_CONSTRAINT_TYPES))
        for key, value in entry.items():
            what, ok = _CONSTRAINT_TYPES[key]
            if not ok(value):
                raise SearchError(f"{where}: {key} must be {what}, got {type(value).__name__}")
        if "objective" not in entry:
            raise SearchError(f"{where} needs an objective")
        out.append(Constraint(**entry))
    return out


def _base_graph(model: Mapping[str, Any]) -> Any:
    """The base graph: a checkpoint, or a model of the zoo (models.zoo, what ``fxforge inspect NAME`` builds)
    captured with the zoo's capture keywords (``hf_input_names`` in [model] replaces the zoo's)."""
    from ..graph.forge_graph import ForgeGraph

    if "checkpoint" in model:
        return ForgeGraph.from_checkpoint(model["checkpoint"])
    from ..models import zoo

    name = model.get("name")
    if name not in zoo.ZOO:
        raise SearchError(f"[model]: name must be one of {sorted(zoo.ZOO)} (or give checkpoint = PATH), got {name!r}")
    built = zoo.build(name)
    labels = getattr(getattr(built.model, "config", None), "num_labels", None)
    if "num_labels" in model and model["num_labels"] != labels:
        raise SearchError(f"[model]: the zoo's {name} has {labels} labels, not {model['num_labels']}; for another "
                          "head give checkpoint = PATH (a model exported with `ForgeGraph(...).export(PATH)`)")
    capture = dict(built.capture)
    if "hf_input_names" in model:
        capture["hf_input_names"] = list(model["hf_input_names"])
    return ForgeGraph(built.model.eval(), share_weights=True, **capture)  # built here: no second copy of its weights


_RUN_LENGTH = ("n_trials", "timeout", "resume", "storage", "mlflow",  # may change between runs of one study
               "prefix_cache")


def _identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What must match for a rerun to continue a study: the config without its run-length keys."""
    out = json.loads(json.dumps(config, sort_keys=True, default=str))
    out["search"] = {k: v for k, v in out.get("search", {}).items() if k not in _RUN_LENGTH}
    return out


def check_resumable(config: Mapping[str, Any], section: Mapping[str, Any]) -> None:
    """Refuse to continue an existing study of this name unless it was created from the same config (up to
    n_trials, timeout, resume and storage): continuing it otherwise mixes trials measured differently."""
    defaults = {f.name: f.default for f in dataclasses.fields(Search)}
    name = section.get("study_name", defaults["study_name"])
    spec, run_dir = StorageSpec(section.get("storage")), Path(section.get("run_dir", defaults["run_dir"]))
    file = spec.file(run_dir)
    if file is not None and not file.exists():  # no study yet: create nothing before the search is built
        return
    storage = open_storage(spec, run_dir)
    if name not in optuna.get_all_study_names(storage):
        return
    stored = optuna.load_study(study_name=name, storage=storage).user_attrs.get(CONFIG_ATTR)
    if stored is None:
        raise SearchError(f"study {name!r} exists but was not created from a config; choose another study_name "
                          "(--study) or run_dir")
    old, new = _identity(json.loads(stored)), _identity(config)
    if old != new:
        differ = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
        raise SearchError(f"study {name!r} exists, created from a different config ({', '.join(differ)} differ); "
                          "continuing it would mix trials measured differently: choose another study_name "
                          "(--study) or run_dir, or restore the config")


def _confine(section: dict[str, Any], given: Mapping[str, Any], root: str | Path | None, allow: bool) -> None:
    """Resolve the paths the config names for writing (run_dir, a journal or SQLite storage file) under the
    output root (graph/output_paths.py); values the caller passed as overrides are the caller's, kept."""
    def resolve(key: str, value: str) -> str:
        return str(resolve_output_path(value, root, allow, f"[search] {key}", SearchError))

    if "run_dir" not in given:
        section["run_dir"] = resolve("run_dir", str(section.get("run_dir", Search.run_dir)))
    storage = section.get("storage")
    if "storage" not in given and isinstance(storage, str):
        if "://" not in storage:
            section["storage"] = resolve("storage", storage)
        elif storage.startswith("sqlite:///") and storage != "sqlite:///":
            section["storage"] = "sqlite:///" + resolve("storage", storage.removeprefix("sqlite:///"))
    if "prefix_cache" not in given and isinstance(section.get("prefix_cache"), str):  # written: confined too
        section["prefix_cache"] = resolve("prefix_cache", section["prefix_cache"])
    if "mlflow" not in given and isinstance(section.get("mlflow"), str):  # a local MLflow store is written too
        section["mlflow"] = confine_local_target(section["mlflow"], lambda p: resolve("mlflow", p))


def search_from_config(config: Mapping[str, Any], *, output_root: str | Path | None = None,
                       allow_outside_root: bool = False, **overrides: Any) -> Search:
    """Build the :class:`Search` a config describes (``overrides`` replace [search] keys, e.g. storage).

    A config describes one study: unless ``resume`` is false, an existing study of the same name created
    from the same config (n_trials, timeout and storage may differ) is continued — ``n_trials`` is the
    study's total, so a larger one adds trials — and one created from another config is refused; with
    ``resume = false`` any existing study of that name is refused.

    Paths the config names for writing (``run_dir``, a journal or ``sqlite:///`` storage) resolve under
    ``output_root`` (default: the current directory); ``..`` or absolute ones are refused unless
    ``allow_outside_root`` (overrides are the caller's own and kept as given)."""
    if not isinstance(config, Mapping):
        raise SearchError(f"a search config must be a table, got {type(config).__name__}")
    _check("top level", config, _SECTIONS)
    section = {"resume": True, **_typed("[search]", config.get("search", {}), _SEARCH_TYPES), **overrides}
    _check("search", section, _SEARCH_KEYS)
    if "objectives" in section:  # a misspelt name is refused naming the built-in ones, before anything is built
        resolve_objectives(section["objectives"])
    if "fidelity" in section:  # a bad schedule is refused before anything is built
        section["fidelity"] = Fidelity.from_spec(section["fidelity"])
    if isinstance(section.get("storage"), str):
        StorageSpec(section["storage"])  # a malformed URL (sqlite:/x.db) is refused, not confined as a path
    _confine(section, overrides, output_root, allow_outside_root)
    model = _typed("[model]", config.get("model", {}), _MODEL_TYPES)
    task_args = _typed("[task]", config["task"], _TASK_TYPES) if "task" in config else None
    constraints = _constraints(config.get("constraints", []))
    if "space" not in config:
        raise SearchError("a search config needs a [space] section")
    space = space_from_spec(config["space"])
    if section["resume"]:
        check_resumable(config, section)
    task = TextClassificationTask(**task_args) if task_args is not None else None
    capture = {"hf_input_names": list(model.get("hf_input_names", ["input_ids", "attention_mask", "labels"]))}
    base = _base_graph(model) if space.needs_graph else None
    return Search(space=space, base=base, task=task, constraints=constraints, capture=capture,
                  config_json=json.dumps(config, sort_keys=True, default=str), **section)
