"""The refusal a graph carries when capture took some modules in eval semantics (graph/training_only): a
small module, called right after the inputs, that raises in train mode.

The graph computes those modules as eager does in eval mode, so training it would silently train without
their stochastic depth, LayerDrop or SpecAugment. The module follows ``train()``/``eval()`` like any other,
is impure (DCE and fx's dead-code elimination keep it), has no tensors, and is allowlisted for checkpoints.
``allow_training_in_eval_semantics(graph)`` is the documented opt-in to train anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn

from . import targets

__all__ = ["GUARD_MODULE", "TrainingOnlyError", "TrainingOnlyGuard", "insert_training_guard",
           "allow_training_in_eval_semantics"]

GUARD_MODULE = "fxforge_training_only"
REMEDY = ("to train it, re-capture the model with that behaviour switched off in its config (e.g. drop_path_rate=0, "
          "layerdrop=0, mask_time_prob=0, or the module's own probability set to 0); or call "
          "fxforge.graph.training_guard.allow_training_in_eval_semantics(graph) to train this graph without it")


class TrainingOnlyError(RuntimeError):
    """A graph holding modules captured in eval semantics was run in train mode."""


class TrainingOnlyGuard(nn.Module):
    """Raise :class:`TrainingOnlyError` when run in train mode, unless ``allow_training`` is set.

    ``modules`` are the module paths captured in eval semantics, ``causes`` why (one per module)."""

    _is_impure = True  # fx's eliminate_dead_code keeps a call_module whose module says so

    def __init__(self, modules: Sequence[str] = (), causes: Sequence[str] = (), allow_training: bool = False) -> None:
        super().__init__()
        self.modules_in_eval = [str(m) for m in modules]
        self.causes = [str(c) for c in causes]
        self.allow_training = bool(allow_training)

    def forward(self) -> None:
        if self.training and not self.allow_training:
            what = "; ".join(self.causes[:6]) + (" ..." if len(self.causes) > 6 else "")
            raise TrainingOnlyError(
                f"this graph was captured with {self.modules_in_eval[:6]} in eval semantics ({what}): in train "
                f"mode it would silently train without that training-only behaviour, so it refuses. Call "
                f"graph.eval() for inference; {REMEDY}")

    def extra_repr(self) -> str:
        return f"modules={self.modules_in_eval}, allow_training={self.allow_training}"


def _config(m: TrainingOnlyGuard) -> dict[str, Any]:
    return {"modules": list(m.modules_in_eval), "causes": list(m.causes), "allow_training": m.allow_training}


def _from_config(config: dict[str, Any]) -> TrainingOnlyGuard:
    modules, causes = config.get("modules", []), config.get("causes", [])
    if not all(isinstance(v, str) for v in (*modules, *causes)) or not isinstance(config.get("allow_training"), bool):
        raise ValueError("TrainingOnlyGuard config: modules and causes must be strings, allow_training a bool")
    return TrainingOnlyGuard(modules, causes, config["allow_training"])


targets.register_module(TrainingOnlyGuard, _config, _from_config, name="fxforge.TrainingOnlyGuard",
                        keys=("modules", "causes", "allow_training"))


def insert_training_guard(gm: fx.GraphModule, causes: dict[str, str]) -> fx.Node:
    """Add the guard module (``causes``: module path -> "path (Class): why" it is in eval semantics) and call it
    after the inputs (and after the shape guard, when there is one)."""
    guard = TrainingOnlyGuard(list(causes), list(causes.values()))
    gm.add_module(GUARD_MODULE, guard)
    nodes = list(gm.graph.nodes)
    last_input = [n for n in nodes if n.op == "placeholder"][-1]
    after = next((n for n in nodes if n.op == "call_function" and n.name == "fxforge_shape_guard"), last_input)
    with gm.graph.inserting_after(after):
        return gm.graph.call_module(GUARD_MODULE, ())


def allow_training_in_eval_semantics(graph: Any, allow: bool = True) -> None:
    """Opt in (or back out) to training a graph whose training-only behaviour was captured in eval semantics:
    train mode then runs those modules as in eval mode (no stochastic depth / LayerDrop / SpecAugment);
    dropout stays switchable. ``graph``: a ForgeGraph or its GraphModule. Kept in checkpoints."""
    gm = getattr(graph, "model", graph)
    guard = getattr(gm, GUARD_MODULE, None)
    if not isinstance(guard, TrainingOnlyGuard):
        raise ValueError("this graph has no training-only guard: it trains like the eager model already")
    guard.allow_training = bool(allow)
