"""Turn the MODEL argument of the CLI into a captured ForgeGraph.

MODEL is, in this order: an fxforge checkpoint directory (has ``manifest.json``), a local HuggingFace
model directory (has ``config.json``), a zoo name (``fxforge.models.zoo``), or a hub name when the hub
is reachable. Anything else is an error naming what was tried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..hub import hub_reachable
from ..models.zoo import ZOO, UnknownModelError, build
from ..quiet import quiet
from .errors import CliError

__all__ = ["load_graph", "model_source"]


def model_source(model: str) -> str:
    """Which kind of MODEL this is: ``checkpoint``, ``hf-dir``, ``zoo`` or ``hub`` (CliError otherwise)."""
    path = Path(model)
    if path.is_dir() and (path / "manifest.json").is_file():
        return "checkpoint"
    if path.is_dir() and (path / "config.json").is_file():
        return "hf-dir"
    if path.exists():
        raise CliError(f"{model}: neither an fxforge checkpoint (manifest.json) nor a HuggingFace model "
                       "directory (config.json)")
    if model in ZOO:
        return "zoo"
    looks_like_hub = "/" in model and not model.startswith((".", "/")) and model.count("/") == 1
    if looks_like_hub and hub_reachable():
        return "hub"
    where = "" if not looks_like_hub else " (the hub is not reachable, so hub names cannot be loaded)"
    raise UnknownModelError(f"unknown model {model!r}{where}; give a zoo name ({', '.join(ZOO)}), a HuggingFace "
                            "model directory or an fxforge checkpoint directory")


def _hf_graph(name_or_path: str) -> ForgeGraph:
    """Capture a HF model: a sequence classifier (with labels → loss) when its config says so, else the base model."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    local = Path(name_or_path).is_dir()
    with quiet():
        if local:
            archs = json.loads((Path(name_or_path) / "config.json").read_text(encoding="utf-8")).get("architectures")
        else:
            archs = AutoConfig.from_pretrained(name_or_path).architectures
        classifier = any(str(a).endswith("ForSequenceClassification") for a in archs or [])
        auto: Any = AutoModelForSequenceClassification if classifier else AutoModel
        model = auto.from_pretrained(name_or_path).eval()
    names = ["input_ids", "attention_mask", "labels"] if classifier else ["input_ids", "attention_mask"]
    with quiet():
        return ForgeGraph(model, hf_input_names=names, share_weights=True)  # the model was built here: no 2nd copy


def load_graph(model: str) -> tuple[ForgeGraph, str]:
    """The captured (or reloaded) graph of MODEL and a short description of where it came from."""
    source = model_source(model)
    if source == "checkpoint":
        return ForgeGraph.from_checkpoint(model), f"fxforge checkpoint {model}"
    if source in ("hf-dir", "hub"):
        return _hf_graph(model), f"HuggingFace model {model}"
    entry = build(model)
    with quiet():
        return ForgeGraph(entry.model, share_weights=True, **entry.capture), f"zoo model {model}: {entry.description}"
