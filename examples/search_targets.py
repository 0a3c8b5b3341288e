"""Time to target: one score saying how far a trial is from all three compression targets, and the report of
when the first trial met them (``time_to_target.json``).

The targets (issue 30): accuracy at most ``max_drop`` below the fine-tuned fp32 model's on the held-out reviews,
weights at least ``min_size_x`` smaller by the packed checkpoint's measured bytes (the weights file of
``graph.export``, counted by graph/checkpoint_packed's ``stored_bytes``; the ``weight_bits`` accounting only when
a trial cannot be exported, said in its notes), and at least ``min_speed_x`` faster than fp32, timed interleaved
with it (the trial as shipped: lowered to real kernels where a lowering applies). Each target is a margin, >= 0
when met: accuracy in units of ``max_drop`` above the bound, size and speed as log2 of the ratio over the target.
The score (:func:`score_of`) sums the shortfalls, so every missed target moves it (the smallest margin alone hid
size and speed while accuracy was the worst), plus a tenth of the smallest margin once all are met: a trial meets
every target exactly when its score is >= 0, and one number lets Optuna's Hyperband pruner compare trials at
every rung (several objectives cannot be pruned).
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxforge.search import Measurement, Objective

if TYPE_CHECKING:
    import optuna

    from fxforge import ForgeGraph
    from fxforge.search import Task

SCORE = "target_score"
REFERENCE_FILE, REPORT_FILE = "targets_reference.json", "time_to_target.json"


@dataclass(frozen=True)
class Targets:
    max_drop: float = 0.01
    min_size_x: float = 8.0
    min_speed_x: float = 2.0


@dataclass(frozen=True)
class Reference:
    """The fp32 model's accuracy on all held-out samples and its packed weight bytes, measured once per run
    (written to the run directory, read by every worker)."""

    accuracy: float
    eval_samples: int
    weight_bytes: float

    @classmethod
    def measure(cls, base: ForgeGraph, task: Task) -> Reference:
        samples = sum(int(labels.shape[0]) for _, labels in task.eval_batches())
        return cls(task.accuracy(base), samples, packed_weight_bytes(base)[0])

    def write(self, run_dir: Path) -> None:
        (run_dir / REFERENCE_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, run_dir: Path) -> Reference:
        return cls(**json.loads((run_dir / REFERENCE_FILE).read_text()))


def packed_weight_bytes(graph: ForgeGraph) -> tuple[float, str]:
    """Bytes the exported checkpoint's weights file stores for the weights (packed, unpacked and lowered), and
    ``"packed"``; ``(weight_bits / 8, "weight_bits")`` when the graph cannot be exported."""
    from fxforge.graph.targets import CheckpointError
    from fxforge.graph.verify import measure_weights
    from fxforge.search.objectives import weight_bits

    training = graph.model.training  # a rung is measured mid fine-tune: export the model as it would ship
    graph.model.eval()
    try:
        with tempfile.TemporaryDirectory(prefix="fxforge-target-") as tmp:
            try:
                path = graph.export(Path(tmp) / "ckpt")
            except CheckpointError:
                return weight_bits(graph) / 8, "weight_bits"
            return float(measure_weights(path).weights), "packed"
    finally:
        graph.model.train(training)


def speedup(base: ForgeGraph, graph: ForgeGraph, task: Task, samples: int, repeats: int) -> tuple[float, str]:
    """fp32 time / the trial's time as shipped, interleaved (median of per-round ratios) on the first ``samples``
    held-out samples; and what was timed (``lowered``, ``simulated`` or ``float``)."""
    from fxforge.benchmarks.timing import interleaved
    from fxforge.search.measured import lowered_for_timing
    from fxforge.search.task import with_labels

    shipped, notes = lowered_for_timing(graph)
    inputs, labels = task.eval_batches()[0]
    inputs, labels = {k: v[:samples] for k, v in inputs.items()}, labels[:samples]

    def forward(g: ForgeGraph) -> None:
        with torch.no_grad():
            g.model(**with_labels(g.model, inputs, labels))

    was = [g.model.training for g in (base, shipped)]
    base.model.eval()
    shipped.model.eval()
    try:
        t = interleaved({"fp32": functools.partial(forward, base), "trial": functools.partial(forward, shipped)},
                        repeats=repeats, warmup=1)
    finally:
        for g, training in zip((base, shipped), was):
            g.model.train(training)
    return t.pair_ratio("fp32", "trial"), str(notes["timed"])


def score_of(margins: dict[str, float]) -> float:
    """The sum of the negative margins, plus a tenth of the smallest margin when none is negative (>= 0 exactly
    when every target is met)."""
    short = sum(min(m, 0.0) for m in margins.values())
    return short + 0.1 * min(margins.values()) if short == 0 else short


def _structure(graph: ForgeGraph) -> tuple[Any, ...]:
    """What size and speed depend on (layer types, shapes, formats), not the trained values: a trial's rungs
    and trials of the same structure share one measurement."""
    from fxforge.search.objectives import weight_bits

    layers = tuple((n, type(m).__name__) for n, m in graph.model.named_modules())
    return weight_bits(graph), layers, tuple(tuple(p.shape) for p in graph.model.parameters())


def target_objective(base: ForgeGraph, reference: Reference, targets: Targets = Targets(),
                     timing_samples: int = 8, repeats: int = 5) -> Objective:
    """The ``target_score`` objective (maximised); its notes hold each measurement and which targets it met
    (met only at the reference's full held-out set: an earlier rung's accuracy is on fewer samples)."""
    measured: dict[tuple[Any, ...], dict[str, Any]] = {}
    r = reference

    def score(graph: ForgeGraph, task: Task | None) -> Measurement:
        assert task is not None
        key = _structure(graph)
        if key not in measured:
            t0 = time.perf_counter()
            weight_bytes, how = packed_weight_bytes(graph)
            speed, timed = (1.0, "same graph") if graph is base else speedup(base, graph, task, timing_samples,
                                                                              repeats)
            measured[key] = {"weight_bytes": weight_bytes, "size_measured": how, "size_x": r.weight_bytes /
                             weight_bytes, "speed_x": speed, "timed": timed, "measure_s": time.perf_counter() - t0}
        m = measured[key]
        samples = sum(int(labels.shape[0]) for _, labels in task.eval_batches())
        acc = r.accuracy if graph is base and samples == r.eval_samples else task.accuracy(graph)
        margins = {"accuracy": (acc - (r.accuracy - targets.max_drop)) / targets.max_drop,
                   "size": math.log2(m["size_x"] / targets.min_size_x),
                   "speed": math.log2(m["speed_x"] / targets.min_speed_x)}
        full = samples == r.eval_samples
        met = {k: full and v >= 0 for k, v in margins.items()}
        return Measurement(score_of(margins), {
            **m, "accuracy": acc, "eval_samples": samples, "fp32_accuracy": r.accuracy,
            "drop_points": 100 * (r.accuracy - acc), "margins": margins, "met": met, "all_met": all(met.values())})

    return Objective(SCORE, "maximize", score, needs_task=True)


def time_to_target(study: optuna.Study, start: float, timeout: float, targets: Targets = Targets(),
                   **extra: Any) -> dict[str, Any]:
    """Each trial's finish time (s after ``start``, a Unix time) and the targets it met, and the time the first
    one within ``timeout`` met all of them (None: none did)."""
    from fxforge.search.runner import trial_result

    rows = []
    for t in study.get_trials(deepcopy=False):
        result = trial_result(t)
        notes = result.get("notes", {}).get(SCORE, {})
        done = t.datetime_complete.timestamp() - start if t.datetime_complete else None
        rows.append({"trial": t.number, "state": t.state.name, "finished_s": done, "params": t.params,
                     "score": t.values[0] if t.values else None, "cached_from": result.get("cached_from"),
                     **{k: notes.get(k) for k in ("accuracy", "drop_points", "size_x", "size_measured", "speed_x",
                                                  "timed", "met", "all_met")},
                     "pruned": result.get("pruned", {}).get("reason"),
                     "rungs": [r.get("values", {}).get(SCORE) for r in result.get("rungs", [])]})
    rows.sort(key=lambda r: (r["finished_s"] is None, r["finished_s"] or 0.0, r["trial"]))
    hits = [r for r in rows if r["all_met"] and r["finished_s"] is not None and r["finished_s"] <= timeout]
    return {"start": datetime.fromtimestamp(start).isoformat(timespec="seconds"), "timeout_s": timeout,
            "targets": asdict(targets), **extra,
            "time_to_target_s": hits[0]["finished_s"] if hits else None,
            "first_trial_meeting_targets": hits[0]["trial"] if hits else None,
            "trials_finished": sum(r["state"] in ("COMPLETE", "PRUNED") for r in rows), "trials": rows}


def write_report(report: dict[str, Any], run_dir: Path) -> Path:
    """Write ``time_to_target.json`` and print its summary lines."""
    path = run_dir / REPORT_FILE
    path.write_text(json.dumps(report, indent=1, default=str))
    for r in report["trials"]:
        if r["finished_s"] is None:
            continue
        met = r["met"] or {}
        print(f"trial {r['trial']:3d} {r['state']:8s} at {r['finished_s']:7.0f} s: "
              + (f"accuracy {r['accuracy']:.3f} ({-r['drop_points']:+.1f} pt), {r['size_x']:.1f}x smaller "
                 f"({r['size_measured']}), {r['speed_x']:.2f}x faster; met {sorted(k for k, v in met.items() if v)}"
                 if r["accuracy"] is not None else (r["pruned"] or "")))
    ttt = report["time_to_target_s"]
    print(f"time to target: {ttt:.0f} s (trial {report['first_trial_meeting_targets']})" if ttt is not None
          else f"time to target: not reached within {report['timeout_s']:.0f} s")
    print(f"written: {path}")
    return path
