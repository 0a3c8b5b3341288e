"""Movement pruning scores (Sanh et al., 2020): ``S = -sum_t w_t * dL/dw_t`` accumulated over fine-tuning steps.

A weight the loss pushes away from zero (``w`` and ``-grad`` of the same sign) gains score; one pushed towards
zero loses it, whatever its magnitude. This is what Taylor (``|w * grad|`` on calibration batches) cannot see:
Taylor ranks by how much the loss depends on a weight now, movement by where training is taking it.

``add_movement_metadata_analysis_pass`` (MASE's name) registers the accumulation: it writes a zero
:class:`MovementRecord` on each selected Linear / Conv node and returns a :class:`MovementTracker` in its info.
The training loop calls ``tracker.step()`` once per optimizer step, after backward and before the update
(or the pass adds the tracker's HF ``TrainerCallback`` to a ``trainer``: ``get_trainer``'s Trainer or any
other; it records at ``on_pre_optimizer_step``, i.e. the clipped gradient the optimizer applies, and at
``on_train_end`` writes the scores and removes itself). ``tracker.flush()`` writes the running scores into
the records; ``prune_transform_pass`` with ``method: "movement"`` reads them. No hook is installed anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import MetaRecord, get_meta, has_meta, register_record
from ..base import forge_pass
from ..contract import PassInfo
from ..rewrite import NoMatchError, describe_candidates
from ..select import parse_selector_fields, select_nodes
from .modules import is_prunable, layer_weight

__all__ = ["MovementRecord", "MovementArgs", "MovementInfo", "MovementTracker", "add_movement_metadata_analysis_pass",
           "movement_scores"]

DEFAULT_TARGETS: dict[str, Any] = {"type": ["linear", "conv1d", "conv2d"]}


@register_record("software.movement")
@dataclass
class MovementRecord(MetaRecord):
    """Movement scores of a layer's ``weight``: ``scores`` flattened row-major (``shape``), summed over ``steps``
    optimizer steps. Higher = more important (kept longer)."""

    steps: int = 0
    shape: tuple[int, ...] = ()
    scores: list[float] = field(default_factory=list)


class MovementTracker:
    """Accumulates ``-w * w.grad`` for the tracked layers' weights at each :meth:`step`; :meth:`flush` writes
    the totals into the nodes' :class:`MovementRecord`. Holds tensors (float64), not hooks."""

    def __init__(self, gm: fx.GraphModule, nodes: Mapping[str, fx.Node]) -> None:
        self._gm, self._nodes = gm, dict(nodes)
        self.scores = {p: torch.zeros(layer_weight(gm.get_submodule(p)).shape, dtype=torch.float64)
                       for p in self._nodes}
        self.steps = 0

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    def step(self) -> None:
        """Add this step's ``-w * grad`` (the weights as they are before the optimizer updates them). A layer
        without a gradient this step (frozen, unused) adds nothing; a step with no gradient at all is an error."""
        seen = 0
        for path, total in self.scores.items():
            w = layer_weight(self._gm.get_submodule(path))
            if w.grad is None:
                continue
            if w.grad.shape != total.shape:
                raise RuntimeError(f"movement: layer {path!r}'s weight is now {tuple(w.grad.shape)}, the tracker "
                                   f"was set up for {tuple(total.shape)}; run add_movement_metadata_analysis_pass "
                                   "again after changing the model")
            total.sub_((w.detach() * w.grad).to(torch.float64))
            seen += 1
        if seen == 0:
            raise RuntimeError("movement: no tracked weight has a gradient; call tracker.step() after "
                               "loss.backward() and before optimizer.zero_grad()")
        self.steps += 1

    def flush(self) -> None:
        """Write the running scores into each tracked node's MovementRecord (what pruning reads)."""
        for path, node in self._nodes.items():
            total = self.scores[path]
            get_meta(node).software.set(MovementRecord(self.steps, tuple(total.shape),
                                                       total.flatten().tolist()))

    def callback(self) -> Any:
        """An HF ``TrainerCallback`` that steps at each optimizer step and flushes (and detaches) at train end."""
        return _trainer_callback(self)


def _trainer_callback(tracker: MovementTracker) -> Any:
    from transformers import TrainerCallback

    class MovementCallback(TrainerCallback):
        """Records movement at ``on_pre_optimizer_step``; writes and removes itself at ``on_train_end``."""

        def __init__(self) -> None:
            self.tracker = tracker
            self.handler: Any = None

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.tracker.step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.tracker.flush()
            if self.handler is not None and self in self.handler.callbacks:
                self.handler.callbacks.remove(self)

    return MovementCallback()


@dataclass(frozen=True)
class MovementArgs:
    """targets / exclude: selectors over Linear / Conv layers (default: every one); trainer: an HF Trainer
    (e.g. from ``fxforge.data.get_trainer``) to record during its next ``train()``; without one, call
    ``info.tracker.step()`` in your loop and ``info.tracker.flush()`` at the end."""

    targets: Any = None
    exclude: Any = None
    trainer: Any = field(default=None, metadata={"data": True})

    def __post_init__(self) -> None:
        parse_selector_fields(self)
        if self.trainer is not None and not hasattr(self.trainer, "add_callback"):
            raise ValueError(f"'trainer' must be an HF Trainer (it has add_callback), got "
                             f"{type(self.trainer).__name__}")


@dataclass(frozen=True)
class MovementInfo(PassInfo):
    """The tracked layers (module paths) and their nodes, weights tracked, steps recorded so far (0), and the
    tracker the training loop drives."""

    layers: tuple[str, ...]
    nodes: tuple[str, ...]
    weights: int
    steps: int
    tracker: MovementTracker


@forge_pass("analysis", MovementArgs, info=MovementInfo, requires=("metadata",))
def add_movement_metadata_analysis_pass(graph: ForgeGraph, args: MovementArgs) -> tuple[ForgeGraph, MovementInfo]:
    """Zero movement records on the selected layers and a tracker to accumulate them during training."""
    gm = graph.model
    targets = DEFAULT_TARGETS if args.targets is None else args.targets
    nodes = {name: node for node, name, m, _ in select_nodes(gm, targets, args.exclude, modules_only=True)
             if m is not None and is_prunable(m)}
    if not nodes:
        raise NoMatchError(f"no Linear / Conv layer matched targets={targets!r} exclude={args.exclude!r}; "
                           f"candidates: {describe_candidates(gm)}")
    tracker = MovementTracker(gm, nodes)
    tracker.flush()
    if args.trainer is not None:
        cb = tracker.callback()
        cb.handler = args.trainer.callback_handler
        args.trainer.add_callback(cb)
    weights = sum(s.numel() for s in tracker.scores.values())
    return graph, MovementInfo(tracker.layers, tuple(n.name for n in nodes.values()), weights, 0, tracker)


def movement_scores(graph: ForgeGraph, layers: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """path -> movement scores shaped like the layer's weight, read from its node's MovementRecord; an error
    naming the pass to run when a layer has none (or has changed shape since)."""
    by_path = {str(n.target): n for n in graph.model.graph.nodes if n.op == "call_module"}
    out: dict[str, torch.Tensor] = {}
    for path, layer in layers.items():
        node = by_path.get(path)
        rec = get_meta(node).software.get(MovementRecord) if node is not None and has_meta(node) else None
        if rec is None:
            raise ValueError(f"method 'movement': layer {path!r} has no movement scores; run "
                             "add_movement_metadata_analysis_pass, train (tracker.step() per optimizer step, or "
                             "its trainer callback), then prune -- or exclude the layer")
        shape = tuple(layer_weight(layer).shape)
        if tuple(rec.shape) != shape or len(rec.scores) != layer_weight(layer).numel():
            raise ValueError(f"method 'movement': layer {path!r}'s scores are for a {tuple(rec.shape)} weight, it "
                             f"is {shape} now; record movement again on this graph")
        if rec.steps == 0:
            raise ValueError(f"method 'movement': layer {path!r} has no recorded training step (tracker.step() "
                             "never ran, or tracker.flush() was not called)")
        out[path] = torch.tensor(rec.scores, dtype=torch.float64).reshape(shape)
    return out
