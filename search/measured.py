"""Objectives measured on what a trial ships: its checkpoint's bytes on disk, and the speed of the model it runs.

``checkpoint_bytes`` exports the trial's graph to a temporary directory and counts the bytes of the
checkpoint's weights file (``weights.safetensors``: every parameter, buffer and constant, quantized
weights at their format's width once checkpoints pack them). The graph JSON, node metadata, example
inputs and reference outputs (tens of kilobytes, whatever the weights) are left out of the value and
recorded beside it, as is the whole directory's size. The number is a file size, not an estimate:
:func:`checkpoint_weight_bytes` of ``graph.export(path)`` gives the same bytes.

``shipped_latency_ms`` times the model that would run when shipped: where a lowering pass maps some of
the trial's quantized layers to real low-bit kernels it times a lowered copy of the graph (the trial's
own graph, accuracy included, stays simulated), else the graph itself. Which one it timed is recorded
beside the value (``timed``: ``lowered``, ``simulated`` or ``float``) in the trial's result.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import SearchError

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph
    from .task import Task

__all__ = ["Measurement", "checkpoint_bytes", "checkpoint_weight_bytes", "lowered_for_timing", "shipped_latency_ms"]


@dataclass(frozen=True)
class Measurement:
    """An objective's value and notes on how it was measured (kept in the trial's result: what a latency
    timed, which files a size counted), so a number in a table can be traced to what produced it."""

    value: float
    notes: Mapping[str, Any] = field(default_factory=dict)


def _weight_files() -> tuple[str, ...]:
    """The checkpoint files that hold weights (the other files are graph structure and example data)."""
    from ..graph.checkpoint_load import WEIGHTS

    return (WEIGHTS,)


def checkpoint_weight_bytes(path: str | Path) -> int:
    """Bytes on disk of the weights file(s) of the checkpoint directory ``path`` (what ``checkpoint_bytes``
    counts); SearchError when ``path`` holds no checkpoint weights."""
    root = Path(path)
    files = [root / name for name in _weight_files()]
    if not any(f.is_file() for f in files):
        raise SearchError(f"{root}: no checkpoint weights file ({', '.join(_weight_files())}) to measure")
    return sum(f.stat().st_size for f in files if f.is_file())


def _dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.iterdir() if f.is_file())


def checkpoint_bytes(graph: ForgeGraph, task: Task | None = None) -> Measurement:
    """Bytes of the weights file of ``graph``'s checkpoint, measured by exporting it to a temporary
    directory (deleted afterwards); notes: the whole directory's bytes and the files counted."""
    from ..graph.targets import CheckpointError

    with tempfile.TemporaryDirectory(prefix="fxforge-size-") as tmp:
        try:
            path = graph.export(Path(tmp) / "checkpoint")
        except CheckpointError as exc:
            raise SearchError(f"objective checkpoint_bytes: the graph cannot be exported as a checkpoint, so its "
                              f"size cannot be measured ({exc}); use weight_bits for an accounted size") from exc
        weights = checkpoint_weight_bytes(path)
        notes = {"files": list(_weight_files()), "checkpoint_dir_bytes": _dir_bytes(path)}
    return Measurement(float(weights), notes)


def lowered_for_timing(graph: ForgeGraph) -> tuple[ForgeGraph, dict[str, Any]]:
    """``graph`` as it would run shipped: a copy lowered by ``lower_weight_only_transform_pass`` (real
    low-bit kernels for every quantized layer whose format has an exact one) when that applies to some
    layer, else ``graph`` itself; plus notes: ``timed`` (``lowered`` when some layer runs a real kernel,
    ``simulated`` when quantized layers only simulate their formats, ``float`` when nothing is quantized),
    ``lowered`` (layers per kernel: int4, int8, int8-dynamic, embedding; ``already``: lowered by the plan
    itself) and ``still_simulated`` (quantized layers without a kernel)."""
    from ..passes.quantize.lower import Int8Linear
    from ..passes.quantize.lower_weight_only import (
        WEIGHT_ONLY_LAYERS,
        lower_weight_only_transform_pass,
        lowering_plan,
    )
    from ..passes.quantize.quantizer import Quantize

    already = sum(isinstance(m, (Int8Linear, *WEIGHT_ONLY_LAYERS)) for m in graph.model.modules())
    plan = lowering_plan(graph)  # quantized layer path -> kernel, or "skip: why"
    lowered: Counter[str] = Counter()
    still = len(plan)
    if any(not how.startswith("skip: ") for how in plan.values()):
        graph = graph.copy()
        graph, info = lower_weight_only_transform_pass(graph)
        lowered.update(how.split()[0] for how in info.lowered.values())
        still = len(info.skipped)
    if already:
        lowered["already"] = already
    simulated = any(isinstance(m, Quantize) for m in graph.model.modules())
    timed = "lowered" if lowered else "simulated" if simulated else "float"
    return graph, {"timed": timed, "lowered": dict(sorted(lowered.items())), "still_simulated": still}


def shipped_latency_ms(graph: ForgeGraph, task: Task | None, repeats: int = 5) -> Measurement:
    """Median forward time (ms, see ``objectives.latency_ms``) of ``graph`` lowered where a lowering applies;
    notes: what was timed and torch's thread count (a latency depends on it)."""
    import torch

    from .objectives import latency_ms

    timed, notes = lowered_for_timing(graph)
    return Measurement(latency_ms(timed, task, repeats), {**notes, "threads": torch.get_num_threads()})
