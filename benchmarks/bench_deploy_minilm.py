"""The fine-tuned MiniLM classifier deployed outside fxforge: ONNX Runtime and AOTInductor beside fp32 eager.

    .venv/bin/python -m fxforge.benchmarks.bench_deploy_minilm [--model fxforge-demo/minilm-lora]
        [--best fxforge-demo/best | --ffn-sparsity F] [--realtime 30] [--quick] [--json OUT]

Artifacts (benchmarks/deploy_runtimes.py builds them): the fp32 graph exported to ONNX; ONNX Runtime's own
``quantize_dynamic`` (QInt8 weights: every op it quantizes, and MatMul/Gemm only) and ``quantize_static``
(QDQ, per-channel, MatMul/Gemm, min-max on ``--calib`` training reviews) of that export; fxforge's int8 QDQ
artifact (every Linear int8, activations calibrated on the same reviews) and its dynamic twin (each batch's
activation range: DynamicQuantizeLinear, as ORT's quantize_dynamic); the search's best point (``--best``)
as QDQ, or when its formats are refused, its pruned + shrunk FFN with the same int8 linears (static and
dynamic); an AOTInductor
package; torch.ao dynamic int8 for reference. Each runtime is timed in its own worker process
(runtime_workers.py; ``--in-process`` times them all in this one, where ORT's and torch's thread pools contend).
Printed, in one run (interleaved rounds, medians): the CPU and
threads, then per shape (batch 8 x 128 and 1 x 128 tokens) each artifact's latency and its ratio to fp32
eager, its bytes and their ratio to the fp32 ONNX file, its accuracy on ``--eval`` held-out reviews and the
difference to the accuracy of the fxforge graph it came from; last, the issue's targets as met / not met.
Timings on a shared machine are noisy; the exit code says only that the run finished.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fxforge.benchmarks import deploy_runtimes as rt  # noqa: E402
from fxforge.benchmarks.bench_minilm_lowered import cpu_model, fine_tuned  # noqa: E402
from fxforge.benchmarks.compile_ceiling import EagerProfile, profile_eager, sgemm_gflops  # noqa: E402
from fxforge.benchmarks.minilm_ship import disk_bytes, prune_ffn  # noqa: E402
from fxforge.benchmarks.runtime_workers import RuntimeWorker, save_inputs  # noqa: E402
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.deploy.ort_options import DISABLED_OPTIMIZERS  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402

TARGETS = {"int8_x_eager": 0.6, "shrunk_x_eager": 0.4, "aoti_x_eager": 0.85, "accuracy_pt": 0.5}
ORT_OWN = ("ORT quantize_dynamic", "ORT quantize_dynamic MatMul", "ORT quantize_static QDQ")
FXFORGE_INT8, SHRUNK, AOTI, EAGER = "fxforge ONNX int8 QDQ", "shrunk + int8 ONNX QDQ", "AOTInductor", "fp32 eager"
FXFORGE_DYN, SHRUNK_DYN = "fxforge ONNX int8 dynamic", "shrunk + int8 dynamic ONNX"


@dataclass
class Variant:
    """One runtime: how to run it, its artifact's bytes (None: no artifact) and the fxforge graph it came from."""

    run: rt.Runner
    bytes: int | None
    reference: str
    how: str = ""
    spec: dict[str, Any] = field(default_factory=dict)  # how a runtime worker loads it (runtime_workers.py)
    accuracy: float = float("nan")
    median_ms: dict[str, float] = field(default_factory=dict)
    samples_ms: dict[str, list[float]] = field(default_factory=dict)  # every timed round, in round order


class Log(list[str]):
    """Notes printed as they happen, with the seconds since the run started (and kept for --json)."""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = time.perf_counter()

    def __call__(self, note: str) -> None:
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {note}", flush=True)
        self.append(note)


def lscpu_model() -> str:
    """``lscpu``'s model name line (falls back to /proc/cpuinfo through cpu_model)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return cpu_model()
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return f"{names[0] if names else '?'}; {cpu_model()}"


def describe_formats(graph: ForgeGraph) -> str:
    """The distinct quantizer formats of ``graph`` by layer type, e.g. ``QuantizedLinear weight mxint(width=3)``."""
    seen: dict[str, int] = {}
    for module in graph.model.modules():
        for role in ("weight", "data_in", "bias", "data_out"):
            q = getattr(module, f"{role}_quantizer", None)
            if q is not None and hasattr(q, "spec"):
                key = f"{type(module).__name__} {role} {q.spec.format}{dict(q.spec.params)}"
                seen[key] = seen.get(key, 0) + 1
    return "; ".join(f"{k} x{n}" for k, n in seen.items()) or "float (no quantizers)"


def ffn_widths(graph: ForgeGraph) -> list[int]:
    """The FFN expansions' output widths (one per layer), the structure a pruned point keeps."""
    return [int(m.out_features) for n, m in graph.model.named_modules() if n.endswith("intermediate.dense")]


def accuracy(run: rt.Runner, batches: Any) -> float:
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in batches:
            correct += int((run(**inputs).argmax(-1) == labels).sum())
            total += int(labels.numel())
    return correct / total


def build(args: argparse.Namespace, work: Path, log: Log) -> tuple[dict[str, Variant], dict[str, float], Any]:
    """Every artifact and reference graph; returns variants, the fxforge graphs' accuracies and the task."""
    from fxforge.quiet import quiet
    from fxforge.search import TextClassificationTask

    base = fine_tuned(Path(args.model))
    with quiet():
        task = TextClassificationTask("imdb", train_size=args.calib, eval_size=args.eval, max_length=args.length,
                                      eval_batch_size=8, progress=False, calibration_size=args.calib)
    calib = task.calibration(base.model)[0]
    log(f"{args.model} loaded; {len(task.data['test'])} held-out and {len(task.data['train'])} calibration reviews")
    graphs: dict[str, ForgeGraph] = {"fp32 graph": base, "fxforge int8 graph": rt.fxforge_int8(base, calib),
                                     "fxforge int8 dynamic graph": rt.fxforge_int8(base, calib, dynamic=True)}
    log("fxforge int8 graph: every Linear int8 (per-channel symmetric weights, per-tensor asymmetric activations, "
        "min-max calibrated); dynamic graph: the same with each batch's activation range")
    fp32_path, how = rt.export_fp32_onnx(base, work / "fp32")
    log(f"fp32 ONNX: {how}, {rt.artifact_bytes(fp32_path)} bytes")
    fp32_bytes = rt.artifact_bytes(fp32_path)
    variants: dict[str, Variant] = {
        EAGER: Variant(rt.eager_runner(base.model), None, "fp32 graph", f"{disk_bytes(base) / 1e6:.1f} MB weights",
                       {"kind": "eager", "path": str(args.model)}),
        "ORT fp32": Variant(rt.ort_session(fp32_path), fp32_bytes, "fp32 graph", how, ort_spec(fp32_path))}
    for name, kind in zip(ORT_OWN, ("dynamic", "dynamic-matmul", "static")):
        path = rt.ort_quantize(fp32_path, work / f"ort-{kind}.onnx", kind, calib)
        variants[name] = Variant(rt.ort_session(path), rt.artifact_bytes(path), "fp32 graph", kind, ort_spec(path))
        log(f"{name}: {rt.artifact_bytes(path)} bytes")
    qdq, how = rt.export_qdq_onnx(graphs["fxforge int8 graph"], work / "int8")
    log(f"{FXFORGE_INT8}: {how}")
    if qdq is not None:
        variants[FXFORGE_INT8] = Variant(rt.ort_session(qdq), rt.artifact_bytes(qdq), "fxforge int8 graph", how,
                                         ort_spec(qdq))
    dyn, how = rt.export_qdq_onnx(graphs["fxforge int8 dynamic graph"], work / "int8-dynamic")
    log(f"{FXFORGE_DYN}: {how}")
    if dyn is not None:
        variants[FXFORGE_DYN] = Variant(rt.ort_session(dyn), rt.artifact_bytes(dyn), "fxforge int8 dynamic graph",
                                        how, ort_spec(dyn))
    shrunk_point(args, base, task, graphs, variants, log, work)
    pt2, names = rt.export_aoti_package(base, work / "aoti")
    log(f"AOTInductor: fxforge.deploy.export_aoti, {rt.artifact_bytes(pt2)} bytes")
    variants[AOTI] = Variant(rt.aoti_runner(pt2, names), rt.artifact_bytes(pt2), "fp32 graph", "export_aoti",
                             {"kind": "aoti", "path": str(pt2), "names": list(names)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(base.model), {torch.nn.Linear}, dtype=torch.qint8)
    variants["torch.ao dynamic int8"] = Variant(rt.eager_runner(ao), None, "fp32 graph", "eager, not an artifact",
                                                {"kind": "ao", "path": str(args.model)})
    acc = {name: accuracy(rt.eager_runner(g.model), task.eval_batches()) for name, g in graphs.items()}
    variants[EAGER].accuracy = acc["fp32 graph"]  # the same module: measured once
    log("fxforge graphs' accuracies: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    return variants, acc, task


def shrunk_point(args: argparse.Namespace, base: ForgeGraph, task: Any, graphs: dict[str, ForgeGraph],
                 variants: dict[str, Variant], log: Log, work: Path) -> None:
    """The search's best point as QDQ; when refused, its pruned + shrunk FFN structure with int8 linears. Without
    a search point, ``--ffn-sparsity`` of the FFN units removed (the demo search's own choices) stands in for it."""
    best_dir = Path(args.best)
    full = ffn_widths(base)
    if (best_dir / "manifest.json").is_file():
        best = ForgeGraph.from_checkpoint(best_dir).eval()
        log(f"best point {best_dir}: FFN widths {sorted(set(ffn_widths(best)))} of "
            f"{sorted(set(full))}; {describe_formats(best)}")
        path, how = rt.export_qdq_onnx(best, work / "best")
        if path is not None:
            graphs["best graph"] = best
            variants["best point ONNX QDQ (as is)"] = Variant(rt.ort_session(path), rt.artifact_bytes(path),
                                                              "best graph", how, ort_spec(path))
        log(f"best point as is, ONNX QDQ: {how}")
        best_widths = ffn_widths(best)
        widths: list[int] | None = best_widths
        sparsity, source = 1 - best_widths[0] / full[0], "the best point's structure"
    elif args.ffn_sparsity is not None:
        widths, sparsity, source = None, args.ffn_sparsity, f"no search point at {best_dir}: --ffn-sparsity"
    else:
        log(f"{SHRUNK}: no search point at {best_dir} (run `make demo`, pass --best CKPT or --ffn-sparsity F): "
            "skipped")
        return
    calib = task.calibration(base.model)
    shrunk: ForgeGraph | None = None
    if widths is not None:  # the point itself: its structure and its trained (fine-tuned) weights, as float
        try:
            shrunk = rt.weights_as_float(best)
            log(f"{SHRUNK}: the best point's own graph ({sparsity:.1%} of FFN units removed, its fine-tuned weights "
                "as its quantizers compute them), every Linear in int8 (per-channel weights; calibrated or dynamic "
                "activations)")
        except ValueError as exc:  # a point quantizing activations: its float twin would compute something else
            log(f"{SHRUNK}: the best point's own weights cannot stand in ({exc}); its FFN structure re-pruned instead")
    if shrunk is None:
        shrunk = prune_ffn(base, sparsity, "taylor", calib)
        log(f"{SHRUNK}: {source} ({sparsity:.1%} of FFN units removed by Taylor importance on {args.calib} "
            "training reviews, not fine-tuned), every Linear in int8 (per-channel weights; calibrated or dynamic "
            "activations)")
    for name, dynamic in ((SHRUNK, False), (SHRUNK_DYN, True)):
        reference = f"shrunk int8{' dynamic' if dynamic else ''} graph"
        graphs[reference] = rt.fxforge_int8(shrunk, calib[0], dynamic=dynamic)
        path, how = rt.export_qdq_onnx(graphs[reference], work / ("shrunk-dynamic" if dynamic else "shrunk"))
        log(f"{name}: {how}")
        if path is not None:
            variants[name] = Variant(rt.ort_session(path), rt.artifact_bytes(path), reference, how, ort_spec(path))


def ort_spec(path: Path) -> dict[str, Any]:
    return {"kind": "ort", "path": str(path)}


def time_shapes(variants: dict[str, Variant], task: Any, batches: list[int], rounds: int, work: Path,
                in_process: bool = False, realtime: int = 0) -> None:
    """Interleaved medians of every timed variant at each batch size (held-out reviews, --length tokens): each
    runtime in its own worker process (runtime_workers.py), or all in this one with ``in_process``."""
    shapes = shape_inputs(task, batches)
    if in_process:
        for shape, inputs in shapes.items():
            with torch.no_grad():
                times = interleaved({k: functools.partial(v.run, **inputs) for k, v in variants.items()}, rounds)
            record(variants, shape, times.times)
        return
    files = {shape: str(save_inputs(inputs, work / f"inputs-{shape}.safetensors")) for shape, inputs in shapes.items()}
    workers: dict[str, RuntimeWorker] = {}
    try:
        for name, v in variants.items():
            workers[name] = RuntimeWorker({**v.spec, "threads": torch.get_num_threads(), "inputs": files,
                                           "realtime": realtime})
        for w in workers.values():
            w.wait_ready()
        for shape in shapes:
            times = interleaved({k: functools.partial(w.time, shape) for k, w in workers.items()}, rounds)
            record(variants, shape, times.times)
    finally:
        for w in workers.values():
            w.close()


def shape_inputs(task: Any, batches: list[int]) -> dict[str, dict[str, torch.Tensor]]:
    """The timed inputs per shape name ("8x"): the first held-out batch's first ``b`` reviews."""
    first = task.eval_batches()[0][0]
    shapes: dict[str, dict[str, torch.Tensor]] = {}
    for b in batches:
        shapes[f"{b}x"] = {k: v[:b] for k, v in first.items()}
        if shapes[f"{b}x"]["input_ids"].shape[0] < b:
            raise SystemExit(f"batch {b} needs at least that many held-out reviews (--eval)")
    return shapes


def ceilings(eager: Variant, task: Any, batches: list[int], length: int, log: Log) -> dict[str, EagerProfile]:
    """The compiled-fp32 ceiling per shape (compile_ceiling.py), from a profile of the eager graph over its timed
    median: how close AOTInductor could get to eager at best when it runs the same GEMMs and attention."""
    sgemm = sgemm_gflops()
    out = {}
    for shape, inputs in shape_inputs(task, batches).items():
        out[shape] = profile_eager(functools.partial(eager.run, **inputs), eager.median_ms.get(shape), sgemm=sgemm)
        log(f"ceiling at {shape}{length}: {out[shape].describe()}")
    return out


def record(variants: dict[str, Variant], shape: str, seconds: dict[str, list[float]]) -> None:
    """Keep every round's time (paired comparisons need them) and the median of each variant at ``shape``."""
    for k, ts in seconds.items():
        variants[k].samples_ms[shape] = [t * 1e3 for t in ts]
        variants[k].median_ms[shape] = statistics.median(ts) * 1e3


def paired_ratio(num: list[float], den: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of the per-round ratios num/den (the rounds are interleaved, so a round's load hits both alike)
    and its 90% bootstrap interval over rounds (fixed seed: the same samples give the same interval)."""
    ratios = np.asarray(num) / np.asarray(den)
    rng = np.random.default_rng(0)
    boot = np.median(ratios[rng.integers(0, len(ratios), size=(resamples, len(ratios)))], axis=1)
    return float(np.median(ratios)), float(np.percentile(boot, 5)), float(np.percentile(boot, 95))


def report(args: argparse.Namespace, variants: dict[str, Variant], acc: dict[str, float], fp32_bytes: int,
           shapes: list[str]) -> dict[str, Any]:
    """Print the table and the targets; return what was printed as numbers."""
    n = args.eval
    print(f"\n{'artifact':<30} " + " ".join(f"{s + str(args.length) + ' ms':>12} {'x eager':>7}" for s in shapes)
          + f" {'MB':>7} {'x fp32':>6} {'accuracy':>8} {'d pt':>6}  reference graph")
    rows: dict[str, Any] = {}
    for name, v in variants.items():
        eager = variants[EAGER].median_ms
        cells = [f"{v.median_ms[s]:>12.1f} {v.median_ms[s] / eager[s]:>7.3f}" if s in v.median_ms
                 else f"{'':>12} {'':>7}" for s in shapes]
        size = f"{v.bytes / 1e6:>7.1f} {v.bytes / fp32_bytes:>6.3f}" if v.bytes else f"{'':>7} {'':>6}"
        diff = 100 * (v.accuracy - acc[v.reference])
        print(f"{name:<30} {' '.join(cells)} {size} {v.accuracy:>8.3f} {diff:>+6.1f}  {v.reference} "
              f"({acc[v.reference]:.3f})")
        rows[name] = {"median_ms": v.median_ms, "samples_ms": v.samples_ms,
                      "x_eager": {s: v.median_ms[s] / eager[s] for s in v.median_ms},
                      "bytes": v.bytes, "x_fp32_bytes": v.bytes / fp32_bytes if v.bytes else None,
                      "accuracy": v.accuracy, "reference": v.reference, "diff_pt": diff, "how": v.how}
    print(f"(accuracy on {n} held-out reviews at {args.length} tokens; d pt: artifact - its fxforge graph; bytes "
          "over the fp32 ONNX file; eager rows have no artifact)")
    return rows


def targets(rows: dict[str, Any], shape: str, length: int, ceiling: EagerProfile | None = None) -> dict[str, Any]:
    """The issue's targets at ``shape`` as met / not met (None: that artifact is missing); AOTInductor's line
    carries this CPU's compiled-fp32 ceiling when profiled (below its first figure a compiler needs GEMMs faster
    than eager's; below the second, faster than this CPU's sgemm)."""
    def x(name: str) -> float | None:
        return rows.get(name, {}).get("x_eager", {}).get(shape)

    def best(names: tuple[str, ...]) -> float | None:
        found = [v for v in (x(n) for n in names) if v is not None]
        return min(found) if found else None

    # fxforge's fastest int8 artifact (static QDQ or dynamic) against ORT's fastest own quantizer
    i8, sh, ao, best_own = best((FXFORGE_INT8, FXFORGE_DYN)), best((SHRUNK, SHRUNK_DYN)), x(AOTI), best(ORT_OWN)

    def le(a: float | None, b: float | None) -> bool | None:
        return None if a is None or b is None else a <= b

    # with every round recorded, "at least as fast" is judged on the paired rounds: not slower beyond noise
    pair, verdict = paired(rows, shape)
    aoti_note = "" if ceiling is None else (f" (this CPU's compiled-fp32 ceiling: {ceiling.floor_x:.3f}x at eager's "
                                            f"GEMM speed, {ceiling.peak_floor_x:.3f}x at its sgemm rate)")
    checks: dict[str, bool | None] = {
        f"fxforge ONNX int8 {_f(i8)}x <= best ORT own quantizer {_f(best_own)}x{pair}":
            le(i8, best_own) if verdict is None else verdict != "slower",
        f"fxforge ONNX int8 {_f(i8)}x <= {TARGETS['int8_x_eager']}x fp32 eager": le(i8, TARGETS["int8_x_eager"]),
        f"shrunk + int8 {_f(sh)}x <= {TARGETS['shrunk_x_eager']}x": le(sh, TARGETS["shrunk_x_eager"]),
        f"AOTInductor {_f(ao)}x <= {TARGETS['aoti_x_eager']}x{aoti_note}": le(ao, TARGETS["aoti_x_eager"])}
    for name, r in rows.items():  # fxforge's artifacts; ORT's own quantizers are references (their rows say)
        if r["bytes"] is not None and name not in ORT_OWN:
            checks[f"{name} accuracy {r['diff_pt']:+.1f} pt within {TARGETS['accuracy_pt']} pt of {r['reference']}"] = \
                abs(r["diff_pt"]) <= TARGETS["accuracy_pt"]
    print(f"\ntargets at {shape}{length} (facts of this run, noisy machine):")
    for what, ok in checks.items():
        print(f"{'missing' if ok is None else 'met    ' if ok else 'NOT met'} {what}")
    return checks


def paired(rows: dict[str, Any], shape: str) -> tuple[str, str | None]:
    """fxforge's fastest int8 artifact over ORT's fastest own quantizer, paired round by round, and the verdict
    (faster / slower / equal within noise, by the 90% interval); ("", None) when the rounds were not recorded."""
    def fastest(names: tuple[str, ...]) -> str | None:
        found = [n for n in names if shape in rows.get(n, {}).get("samples_ms", {})]
        return min(found, key=lambda n: rows[n]["median_ms"][shape]) if found else None

    mine, theirs = fastest((FXFORGE_INT8, FXFORGE_DYN)), fastest(ORT_OWN)
    if mine is None or theirs is None:
        return "", None
    r, lo, hi = paired_ratio(rows[mine]["samples_ms"][shape], rows[theirs]["samples_ms"][shape])
    verdict = "faster" if hi < 1 else "slower" if lo > 1 else "equal within noise"
    return f" ({mine} / {theirs} paired over rounds {r:.3f}, 90% interval {lo:.3f}-{hi:.3f}: {verdict})", verdict


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fxforge-demo/minilm-lora", help="fine-tuned fp32 fxforge checkpoint")
    parser.add_argument("--best", default="fxforge-demo/best", help="the search's best point (a checkpoint)")
    parser.add_argument("--ffn-sparsity", type=float, default=None, metavar="F",
                        help="without a --best checkpoint, the shrunk point removes this fraction of FFN units "
                             "(the demo search chooses 0.375 or 0.5)")
    parser.add_argument("--eval", type=int, default=1000, help="held-out reviews for accuracy")
    parser.add_argument("--calib", type=int, default=256, help="training reviews calibrating static int8")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batches", default="8,1", help="batch sizes timed (comma-separated)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--in-process", action="store_true",
                        help="time every runtime in this process (default: each in its own worker process)")
    parser.add_argument("--realtime", type=int, default=0, metavar="PRIORITY",
                        help="run the timing workers at this SCHED_RR priority (root; e.g. 50 on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="64 reviews, 32 calibration reviews, 3 rounds")
    parser.add_argument("--keep", default=None, help="keep the artifacts in this directory")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    if args.quick:
        args.eval, args.calib, args.rounds = min(args.eval, 64), min(args.calib, 32), min(args.rounds, 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {lscpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads (ORT "
          f"intra_op_num_threads the same; every ORT session without {', '.join(DISABLED_OPTIMIZERS)}, "
          f"deploy/ort_options.py); load average {os.getloadavg()[0]:.1f}; timing "
          + ("in this process" if args.in_process else "each runtime in its own process"
             + (f" at SCHED_RR {args.realtime}" if args.realtime else "")))
    log = Log()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fxforge-deploy-bench-"))
    try:
        variants, acc, task = build(args, work, log)
        fp32_bytes = variants["ORT fp32"].bytes or 1
        time_shapes(variants, task, batches, args.rounds, work, args.in_process, args.realtime)
        log(f"timed {len(variants)} variants at batches {batches}, {args.rounds} rounds")
        for v in variants.values():
            if v.accuracy != v.accuracy:  # NaN: not measured yet
                v.accuracy = accuracy(v.run, task.eval_batches())
        log("accuracies measured")
        ceiling = ceilings(variants[EAGER], task, batches, args.length, log)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    shapes = [f"{b}x" for b in batches]
    rows = report(args, variants, acc, fp32_bytes, shapes)
    checks = targets(rows, f"{batches[0]}x", args.length, ceiling.get(f"{batches[0]}x"))
    if args.json:
        doc = {"cpu": lscpu_model(), "threads": torch.get_num_threads(), "length": args.length, "batches": batches,
               "rounds": args.rounds, "eval_reviews": len(task.data["test"]), "graph_accuracy": acc,
               "fp32_onnx_bytes": fp32_bytes, "artifacts": rows, "targets": checks, "notes": list(log),
               "loadavg": os.getloadavg(), "ceiling": {k: {**c.__dict__, "other_ms": c.other_ms, "floor_x": c.floor_x,
                                                           "peak_floor_x": c.peak_floor_x}
                                                       for k, c in ceiling.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
