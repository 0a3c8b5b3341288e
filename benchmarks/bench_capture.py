"""Capture cost on the MiniLM classifier: ratios to one eager forward (batch 8 x 128) and to a bare torch.export
with the same dynamic setting, warm (median of repeats in one process) and cold (first capture of a fresh
process), plus a re-capture of the same architecture with other weights (the architecture cache).

    PYTHONPATH=<dir holding fxforge> .venv/bin/python -m fxforge.benchmarks.bench_capture [--repeats 3] [--no-cold]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.benchmarks.timing import best_time, interleaved  # noqa: E402
from fxforge.graph import capture as capture_module  # noqa: E402
from fxforge.graph.capture import _dynamic_shapes  # noqa: E402
from fxforge.graph.hf import hf_dummy_inputs  # noqa: E402
from fxforge.graph.inputs import ExampleInputs  # noqa: E402
from fxforge.models.bert import minilm_for_sequence_classification  # noqa: E402

NAMES = ["input_ids", "attention_mask", "labels"]


def _bare_export(model: torch.nn.Module, dynamic: bool) -> Callable[[], Any]:
    """torch.export of the same dummy inputs and dynamic spec fxforge uses, then .module() (what a user runs)."""
    example = ExampleInputs(kwargs=hf_dummy_inputs(model, NAMES))
    shapes = _dynamic_shapes(example) if dynamic else None

    def run() -> Any:
        ep = torch.export.export(model, (), example.kwargs, dynamic_shapes=shapes, strict=False)
        return ep.module()
    return run


_TRACE: list[float] = []  # seconds spent in torch.export (+ .module(), guard spec) inside each ForgeGraph
_trace_export = capture_module._trace_export


def _timed_trace(*args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return _trace_export(*args, **kwargs)
    finally:
        _TRACE.append(time.perf_counter() - t0)


capture_module._trace_export = _timed_trace


def _capture(model: torch.nn.Module, dynamic: bool) -> Callable[[], Any]:
    def run() -> float:
        t0 = time.perf_counter()
        ForgeGraph(model, hf_input_names=NAMES, dynamic=dynamic, cache=False)
        total = time.perf_counter() - t0
        _OWN.setdefault(dynamic, []).append((total - _TRACE[-1]) / _TRACE[-1])
        return total
    return run


_OWN: dict[bool, list[float]] = {}  # fxforge's own time (normalise, guards, notes) / its torch.export time
_CPU: dict[str, list[float]] = {}  # CPU seconds of this process per variant run (fairer than wall time on a busy box)


def _cpu_timed(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        t0 = time.process_time()
        try:
            return fn()
        finally:
            _CPU.setdefault(name, []).append(time.process_time() - t0)
    return run


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def cold(variant: str) -> None:
    """Print the seconds of the first capture in this process (run in a fresh subprocess)."""
    model = minilm_for_sequence_classification(seed=0).eval()
    kind, setting = variant.split(":")
    fn = _bare_export(model, setting == "dynamic") if kind == "export" else _capture(model, setting == "dynamic")
    t0 = time.perf_counter()
    fn()
    print(f"{time.perf_counter() - t0:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-process (cold) measurements")
    parser.add_argument("--cold-variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_variant:
        cold(args.cold_variant)
        return
    model = minilm_for_sequence_classification(seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, model.config.vocab_size, (8, 128), generator=gen),
              "attention_mask": torch.ones(8, 128, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long)}
    with torch.no_grad():
        t_fwd = best_time(lambda: model(**inputs))
    variants = {"export:dynamic": _bare_export(model, True), "fxforge:dynamic": _capture(model, True),
                "export:static": _bare_export(model, False), "fxforge:static": _capture(model, False)}
    t = interleaved({name: _cpu_timed(name, fn) for name, fn in variants.items()},
                    repeats=args.repeats, warmup=1).medians()
    cpu = {name: _median(times[1:]) for name, times in _CPU.items()}  # the first run of each is the warm-up

    # A fresh instance fills the architecture cache (capturing with labels sets config.problem_type on the model
    # it traces, so `model`, already traced, has another config than fresh instances).
    mg = ForgeGraph(minilm_for_sequence_classification(seed=9).eval(), hf_input_names=NAMES)
    t0 = time.perf_counter()
    passes.init_metadata_analysis_pass(mg)
    passes.add_common_metadata_analysis_pass(mg)
    t_meta = time.perf_counter() - t0
    others = [minilm_for_sequence_classification(seed=s).eval() for s in (1, 2, 3, 4, 5)]
    hits = []
    for other in others:  # same architecture, other weights (a fresh classifier head per seed)
        t0 = time.perf_counter()
        hit = ForgeGraph(other, hf_input_names=NAMES)
        hits.append(time.perf_counter() - t0)
        assert "capture cache hit" in hit.capture_notes[-1], hit.capture_notes
    hit.eval()
    with torch.no_grad():
        err = float((hit(**inputs).logits - others[-1](**inputs).logits).abs().max())
    t_hit = sorted(hits)[len(hits) // 2]

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, MiniLM-L6 classifier")
    print(f"eager forward (batch 8 x 128, best of 7):           {t_fwd * 1e3:9.1f} ms")
    for setting in ("dynamic", "static"):
        e, f = t[f"export:{setting}"], t[f"fxforge:{setting}"]
        print(f"warm {setting:7s} bare torch.export + .module():      {e * 1e3:9.1f} ms  {e / t_fwd:6.1f}x forward")
        print(f"warm {setting:7s} ForgeGraph (export+normalize+guard): {f * 1e3:9.1f} ms  {f / t_fwd:6.1f}x forward  "
              f"vs bare eval-mode export {100 * (f / e - 1):+5.1f}% wall")
        ce, cf = cpu[f"export:{setting}"], cpu[f"fxforge:{setting}"]
        print(f"     {setting:7s} CPU time: bare export {ce * 1e3:9.1f} ms, ForgeGraph {cf * 1e3:9.1f} ms: "
              f"{100 * (cf / ce - 1):+5.1f}% (the same comparison, not skewed by other processes' load)")
        own = _median(_OWN[setting == "dynamic"])
        print(f"     {setting:7s} fxforge's own work (normalise, guards) on top of its own torch.export call: "
              f"{100 * own:+5.1f}%  (its export runs in train mode, dropout traced by stand-in ops: "
              "graph/dropout_tracing)")
    print(f"metadata passes (init + common, dummy inputs):      {t_meta * 1e3:9.1f} ms  {t_meta / t_fwd:6.1f}x forward "
          f"({100 * t_meta / t['export:dynamic']:.1f}% of a dynamic export)")
    print(f"re-capture, same architecture, other weights (hit): {t_hit * 1e3:9.1f} ms  {t_hit / t_fwd:6.2f}x forward  "
          f"(median of {len(hits)}; max |graph - eager| {err:.1e})")
    if not args.no_cold:
        for variant in ("export:dynamic", "fxforge:dynamic", "export:static", "fxforge:static"):
            out = subprocess.run([sys.executable, "-m", "fxforge.benchmarks.bench_capture", "--cold-variant", variant],
                                 capture_output=True, text=True, check=True, env=os.environ)
            c = float(out.stdout.strip().splitlines()[-1])
            print(f"cold {variant:16s} (first in a fresh process):    {c * 1e3:9.1f} ms  {c / t_fwd:6.1f}x forward")


if __name__ == "__main__":
    main()
