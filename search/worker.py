"""Join a shared study as one more worker (``fxforge search worker --storage postgresql://… --study NAME``).

The worker rebuilds the search from the config stored in the study by whoever created it (no config
file needs to travel), then evaluates trials until the study holds its target count. Its sampler is
seeded apart from the other workers' (by its process id unless ``worker=`` gives an index): workers joining
at the same trial count would otherwise sample the same points. Each worker
heartbeats (PostgreSQL and SQLite); a worker killed mid-trial leaves a trial that another worker's
heartbeat check (or a resume) marks failed and re-queues with the same parameters.
"""

from __future__ import annotations

import json
import os
from typing import Any

import optuna

from .config import CONFIG_ATTR, search_from_config
from .errors import SearchError
from .storage import StorageSpec, open_storage

__all__ = ["study_config", "worker"]


def worker(study_name: str, storage: str, **overrides: Any) -> Any:
    """Run trials of the existing study ``study_name`` at ``storage``; returns its SearchResult."""
    overrides.setdefault("worker", os.getpid())
    search = search_from_config(study_config(study_name, storage), storage=storage, study_name=study_name,
                                resume=True, allow_outside_root=True, **overrides)  # its run_dir was its creator's
    return search.run()


def study_config(study_name: str, storage: str) -> dict[str, Any]:
    """The config stored in the shared study ``study_name`` by whoever created it (what a worker rebuilds)."""
    from pathlib import Path

    spec = StorageSpec(storage)
    if spec.kind == "journal":
        raise SearchError("workers share a study through a database: pass storage='postgresql://…' (or sqlite:///…)")
    opened = open_storage(spec, Path("."))
    try:
        study = optuna.load_study(study_name=study_name, storage=opened)
    except KeyError:
        raise SearchError(f"no study named {study_name!r} at that storage; start it with `fxforge search CONFIG.toml "
                          "--storage …` first") from None
    config = study.user_attrs.get(CONFIG_ATTR)
    if config is None:
        raise SearchError(f"study {study_name!r} was not created from a config, so a worker cannot rebuild it; "
                          "call Search(...).run() with the same arguments and resume=True instead")
    return dict(json.loads(config))
