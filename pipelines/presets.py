"""Named pipelines: ``Pipeline.preset("int8-fast")``, ``Pipeline.preset("lora-finetune", args={...})``.

A preset is a plain document (as a TOML file would give); ``args`` merges per-pass arguments into it
by pass name (e.g. the fine-tune's dataset), so data never has to live in the preset itself.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .steps import PipelineError

if TYPE_CHECKING:
    from .pipeline import Pipeline

__all__ = ["PRESETS", "SCALED_INT8", "preset_pipeline"]


def _linear(config: dict[str, Any]) -> dict[str, Any]:
    return {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": config}}


# int8 weights per output channel; int8 activations per tensor, static (calibrated) or computed per batch.
SCALED_INT8 = _linear({"name": "scaled_integer", "data_in_width": 8, "data_in_symmetric": False,
                       "weight_width": 8, "weight_granularity": "per_channel"})
DYNAMIC_INT8 = _linear({"name": "scaled_integer", "data_in_width": 8, "data_in_symmetric": False,
                        "data_in_dynamic": True, "weight_width": 8, "weight_granularity": "per_channel"})

PRESETS: dict[str, dict[str, Any]] = {
    "int8-fast": {"name": "int8-fast", "steps": [
        {"pass": "remove_dropout_transform_pass"},
        {"pass": "quantize_transform_pass", "args": SCALED_INT8},
        {"pass": "calibrate_transform_pass"},
        {"pass": "lower_int8_transform_pass"},
    ]},
    "int8-dynamic": {"name": "int8-dynamic", "steps": [
        {"pass": "remove_dropout_transform_pass"},
        {"pass": "quantize_transform_pass", "args": DYNAMIC_INT8},
        {"pass": "lower_int8_transform_pass"},
    ]},
    "lora-finetune": {"name": "lora-finetune", "steps": [
        # PEFT's sequence-classification recipe: adapters on the encoder, the classifier head fully trained
        {"pass": "insert_lora_adapter_transform_pass",
         "args": {"rank": 8, "alpha": 16.0, "trainable": {"name": "classifier"}}},
        {"pass": "finetune"},
        {"pass": "fuse_lora_weights_transform_pass"},
    ]},
}


def preset_document(name: str, args: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The preset's document with ``args[pass]`` merged into that pass's step args."""
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=2)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise PipelineError(f"unknown pipeline preset {str(name)[:100]!r}; {hint}presets: {sorted(PRESETS)}")
    doc = copy.deepcopy(PRESETS[name])
    extra = dict(args or {})
    names = [s["pass"] for s in doc["steps"]]
    unknown = sorted(k for k in extra if k not in names)
    if unknown:
        raise PipelineError(f"preset {name!r}: args for pass(es) {unknown} not in it; its passes: {names}")
    for step in doc["steps"]:
        if step["pass"] in extra:
            step["args"] = {**step.get("args", {}), **extra[step["pass"]]}  # data is kept by reference
    return doc


def preset_pipeline(name: str, args: Mapping[str, Mapping[str, Any]] | None = None, **overrides: Any) -> Pipeline:
    """``Pipeline.preset(name, args=..., verify=..., data=...)``."""
    from .pipeline import Pipeline

    return Pipeline.from_dict(preset_document(name, args), **overrides)
