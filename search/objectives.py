"""Objectives and constraints of a search: accuracy, latency, checkpoint size, weight memory, parameter count,
peak training memory.

Each objective is a name, a direction and a measurement of the trial's finished graph. Latency
(``latency_ms``) is the median of a few timed forwards of the model as shipped: lowered to real low-bit
kernels where a lowering applies, else the graph itself (search/measured.py; the trial's result says which
it timed). ``checkpoint_bytes`` is the measured size of the exported checkpoint's weights file.
``weight_bits`` is an accounting, not a measurement: every parameter (and int8 weight buffer) at the bits
it is stored or simulated at, so quantized layers count their format's bits, lowered layers their codes at their
width plus the scales their kernel reads (and the bias), and physically pruned layers
count their smaller shapes (element-wise zeros do not save memory and are not counted as saved).
``peak_train_mb`` is measured: the allocator's peak (MB = 2^20 bytes) over one training step (forward and
backward, train mode) of the trial's graph on the task's first training batch (else its first eval batch,
else the graph's example inputs), from torch.profiler's per-allocation memory events: the liveness analysis's
own measured step (passes/analysis/step_memory.py), weight gradients allocated before the step and not counted.
"""

from __future__ import annotations

import difflib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..passes.batching import run_batch
from .errors import SearchError
from .measured import Measurement, checkpoint_bytes, shipped_latency_ms

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph
    from .task import Task

__all__ = ["OBJECTIVES", "Constraint", "Measurement", "Objective", "latency_ms", "measure_objectives", "param_count",
           "peak_train_mb", "weight_bits"]

Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Objective:
    """A named measurement of a trial's graph and whether larger or smaller is better; ``measure`` returns
    the value, or a :class:`Measurement` (value and notes on how it was measured, kept in the trial's result)."""

    name: str
    direction: Direction
    measure: Callable[[ForgeGraph, Task | None], float | Measurement]
    needs_task: bool = False  # measured on the task's data: a search without a task is refused before any trial


def measure_objectives(objectives: Sequence[Objective], graph: ForgeGraph,
                       task: Task | None) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Each objective's value on ``graph`` by name, and the notes of those measured with notes (one place for
    trials and the baseline, so both are measured the same way)."""
    values: dict[str, float] = {}
    notes: dict[str, dict[str, Any]] = {}
    for o in objectives:
        got = o.measure(graph, task)
        if isinstance(got, Measurement):
            values[o.name], notes[o.name] = float(got.value), dict(got.notes)
        else:
            values[o.name] = float(got)
    return values, notes


def weight_bits(graph: ForgeGraph) -> float:
    """Total bits of the graph's weights: quantized parameters at their format's bits, others at dtype bits, and
    lowered layers' weight buffers at their format's bits (codes at their width plus the scales their kernel reads
    and the bias, as each class registers with ``graph.packed.register_lowered``)."""
    from ..graph.packed import lowered_weight_bits
    from ..passes.quantize.quantizer import Quantize

    model = graph.model
    quant_bits: dict[str, float] = {}
    for path, module in model.named_modules():
        if isinstance(module, Quantize) and module.is_param and path.endswith("_quantizer"):
            owner, _, attr = path.rpartition(".")
            quant_bits[f"{owner}.{attr.removesuffix('_quantizer')}".lstrip(".")] = float(module.bits)
    total, seen = lowered_weight_bits(model)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if b.dtype == torch.int8)]
    for name, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        bits = quant_bits.get(name, float(t.element_size() * 8))
        total += bits * t.numel()
    return total


def avg_weight_bits(graph: ForgeGraph) -> float:
    count = sum(p.numel() for p in graph.model.parameters())
    return weight_bits(graph) / count if count else 0.0


def param_count(graph: ForgeGraph) -> float:
    return float(sum(p.numel() for p in graph.model.parameters()))


def latency_ms(graph: ForgeGraph, task: Task | None, repeats: int = 5) -> float:
    """Median wall time (ms) of ``repeats`` forwards on the first eval batch (or the example inputs)."""
    batch: Any
    if task is not None and task.eval_batches():
        from .task import with_labels

        batch = with_labels(graph.model, *task.eval_batches()[0])
    elif graph.example_inputs is not None:
        batch = graph.example_inputs
    else:
        raise SearchError("latency needs a task with eval batches or a graph with example inputs")
    model = graph.model
    was_training = model.training
    model.eval()
    times = []
    try:
        with torch.no_grad():
            run_batch(model, batch)  # warm-up
            for _ in range(repeats):
                start = time.perf_counter()
                run_batch(model, batch)
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        model.train(was_training)
    return statistics.median(times)


def _step_batch(graph: ForgeGraph, task: Task | None) -> tuple[Any, str]:
    """The batch a training step is measured on, and which one it is (recorded beside the value)."""
    from .task import with_labels

    inner: Task | None = getattr(task, "inner", task)  # a fidelity's view: its full batches, same at every rung
    training = getattr(inner, "training_batches", None)
    if training:
        return with_labels(graph.model, *training[0]), "training batch 0"
    if inner is not None and inner.eval_batches():
        return with_labels(graph.model, *inner.eval_batches()[0]), "eval batch 0"
    if graph.example_inputs is not None:
        return graph.example_inputs, "example inputs"
    raise SearchError("objective peak_train_mb needs a task with batches or a graph with example inputs")


def peak_train_mb(graph: ForgeGraph, task: Task | None) -> Measurement:
    """Peak memory (MB) the allocator reaches in one forward + backward of ``graph`` in train mode; the graph's
    mode, gradients and the global RNG stream (dropout draws) are left as they were."""
    from ..graph.inputs import ExampleInputs
    from ..passes.analysis.step_memory import measured_step_bytes
    from ..passes.propagate import flat_inputs

    batch, source = _step_batch(graph, task)
    model = graph.model
    flat = flat_inputs(model, ExampleInputs.coerce(batch))
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[]):
            peak = measured_step_bytes(model, flat)
    except ValueError as exc:  # e.g. every parameter frozen: no backward to measure
        raise SearchError(f"objective peak_train_mb: {exc}") from exc
    finally:
        model.train(was_training)
    shapes = {k: list(v.shape) for k, v in ExampleInputs.coerce(batch).tensors().items()}
    return Measurement(peak / 2**20, {"bytes": peak, "batch": source, "shapes": shapes})


def _accuracy(graph: ForgeGraph, task: Task | None) -> float:
    if task is None:
        raise SearchError("the accuracy objective needs a task (evaluation data)")
    return task.accuracy(graph)


OBJECTIVES: dict[str, Objective] = {
    "accuracy": Objective("accuracy", "maximize", _accuracy, needs_task=True),
    "latency_ms": Objective("latency_ms", "minimize", shipped_latency_ms),
    "checkpoint_bytes": Objective("checkpoint_bytes", "minimize", checkpoint_bytes),
    "weight_bits": Objective("weight_bits", "minimize", lambda g, t: weight_bits(g)),
    "avg_weight_bits": Objective("avg_weight_bits", "minimize", lambda g, t: avg_weight_bits(g)),
    "param_count": Objective("param_count", "minimize", lambda g, t: param_count(g)),
    "peak_train_mb": Objective("peak_train_mb", "minimize", peak_train_mb),
}


def resolve_objectives(names: Any) -> tuple[Objective, ...]:
    """Objective objects by name (or given objects); SearchError listing the built-in names."""
    if isinstance(names, str | Objective):
        names = [names]
    out = []
    for n in names:
        if isinstance(n, Objective):
            out.append(n)
        elif n in OBJECTIVES:
            out.append(OBJECTIVES[n])
        else:
            close = difflib.get_close_matches(str(n), OBJECTIVES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SearchError(f"unknown objective {n!r}{hint}; built-in: {sorted(OBJECTIVES)} (or pass an Objective)")
    if not out:
        raise SearchError("a search needs at least one objective")
    if len({o.name for o in out}) != len(out):
        raise SearchError(f"objectives repeat: {[o.name for o in out]}")
    return tuple(out)


@dataclass(frozen=True)
class Constraint:
    """``max_drop`` of a maximised objective from the base graph's value (e.g. accuracy drop ≤ 0.01),
    or an absolute ``max_value`` / ``min_value``. Feasible when :meth:`violation` ≤ 0."""

    objective: str
    max_drop: float | None = None
    max_value: float | None = None
    min_value: float | None = None

    def __post_init__(self) -> None:
        """Refuse bounds no trial could be judged by (none at all, a negative drop, an empty interval)."""
        where = f"constraint on {self.objective!r}"
        bounds = {k: getattr(self, k) for k in ("max_drop", "max_value", "min_value") if getattr(self, k) is not None}
        if not bounds:
            raise SearchError(f"{where} needs max_drop, max_value or min_value")
        for key, value in bounds.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
                raise SearchError(f"{where}: {key} must be a number, got {value!r}")
        if self.max_drop is not None and self.max_drop < 0:
            raise SearchError(f"{where}: max_drop must be a number >= 0, got {self.max_drop}")
        if self.min_value is not None and self.max_value is not None and self.min_value > self.max_value:
            raise SearchError(f"{where}: min_value {self.min_value} > max_value {self.max_value}: nothing is feasible")

    def violation(self, values: Mapping[str, float], baseline: Mapping[str, float]) -> float:
        v = values[self.objective]
        parts = []
        if self.max_drop is not None:
            if self.objective not in baseline:
                raise SearchError(f"constraint on {self.objective!r} drop needs its baseline value")
            parts.append(baseline[self.objective] - v - self.max_drop)
        if self.max_value is not None:
            parts.append(v - self.max_value)
        if self.min_value is not None:
            parts.append(self.min_value - v)
        return max(parts) if parts else 0.0
