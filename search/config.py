"""A search described as data (a TOML file or a dict): what ``fxforge search CONFIG.toml`` runs and
what a worker on another machine rebuilds from the study itself.

::

    [search]                      # study_name, n_trials, sampler, pruner, objectives, storage, run_dir, seed
    study_name = "minilm-joint"
    objectives = ["accuracy", "avg_weight_bits"]
    [model]                       # name = "minilm" | "tiny-bert", or checkpoint = "path/to/fxforge/checkpoint"
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

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import SearchError
from .objectives import Constraint
from .runner import CONFIG_ATTR, Search
from .space import space_from_spec
from .task import TextClassificationTask

__all__ = ["CONFIG_ATTR", "load_config", "search_from_config"]

_SECTIONS = ("search", "model", "task", "space", "constraints")
_SEARCH_KEYS = ("study_name", "n_trials", "sampler", "pruner", "objectives", "storage", "run_dir", "seed", "resume",
                "timeout")
_MODEL_KEYS = ("name", "checkpoint", "hf_input_names", "num_labels")


def load_config(path: str | Path) -> dict[str, Any]:
    """Parse a search TOML file; a syntax error names the file and line."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SearchError(f"{path}: no such search config") from None
    except tomllib.TOMLDecodeError as exc:
        raise SearchError(f"{path}: {exc}") from None


def _check(section: str, given: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    bad = sorted(set(given) - set(allowed))
    if bad:
        raise SearchError(f"[{section}]: unknown key(s) {bad}; allowed: {sorted(allowed)}")


def _base_graph(model: Mapping[str, Any]) -> Any:
    from ..graph.forge_graph import ForgeGraph

    if "checkpoint" in model:
        return ForgeGraph.from_checkpoint(model["checkpoint"])
    from ..models import bert

    name = model.get("name")
    builders = {"minilm": lambda: bert.minilm_for_sequence_classification(int(model.get("num_labels", 2))),
                "tiny-bert": lambda: bert.tiny_bert(num_labels=int(model.get("num_labels", 2)))}
    if name not in builders:
        raise SearchError(f"[model]: name must be one of {sorted(builders)} (or give checkpoint = PATH), got {name!r}")
    names = model.get("hf_input_names", ["input_ids", "attention_mask", "labels"])
    return ForgeGraph(builders[name]().eval(), hf_input_names=list(names))


def search_from_config(config: Mapping[str, Any], **overrides: Any) -> Search:
    """Build the :class:`Search` a config describes (``overrides`` replace [search] keys, e.g. storage)."""
    _check("top level", config, _SECTIONS)
    section = {**dict(config.get("search", {})), **overrides}
    _check("search", section, _SEARCH_KEYS)
    model = dict(config.get("model", {}))
    _check("model", model, _MODEL_KEYS)
    if "space" not in config:
        raise SearchError("a search config needs a [space] section")
    space = space_from_spec(config["space"])
    task = TextClassificationTask(**dict(config["task"])) if "task" in config else None
    constraints = []
    for c in config.get("constraints", []):
        _check("constraints", c, ("objective", "max_drop", "max_value", "min_value"))
        constraints.append(Constraint(**c))
    capture = {"hf_input_names": list(model.get("hf_input_names", ["input_ids", "attention_mask", "labels"]))}
    base = _base_graph(model) if space.needs_graph else None
    return Search(space=space, base=base, task=task, constraints=constraints, capture=capture,
                  config_json=json.dumps(config, sort_keys=True), **section)
