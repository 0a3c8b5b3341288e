"""The MiniLM classifier shipped small and fast: the demo's kind of point lowered, beside fp32 and the anchors.

    .venv/bin/python -m fxforge.benchmarks.bench_minilm_lowered [--model fxforge-demo/minilm-lora] [--quick]

The point (benchmarks/minilm_ship.py): ``--ffn`` of every FFN's units removed, linears in int8 (dynamic 8-bit
activations), embeddings in 4 bits per row; lowered with ``lower_weight_only_transform_pass`` (Int8Linear +
WeightOnlyEmbedding). ``--model`` is a fine-tuned fp32 checkpoint (what `make demo` saves; run it first: a
missing checkpoint is refused). Printed, in one run:

1. the CPU, threads and load, then the ceiling: the point's Linear multiply-accumulates over fp32's at
   8 x 128 tokens (compute-bound at this shape: fewer MACs and int8 GEMMs are what can make it faster);
2. sizes measured: the weights file on disk and parameter + buffer bytes in memory, fp32 vs lowered (target
   <= 1/8 both);
3. forward latency at batch 8 x 128 tokens, interleaved rounds, medians: the unpruned fp32 graph, the
   lowered point (target <= 0.45x), torch.ao dynamic int8 (``quantize_dynamic`` on the fp32 graph's Linears)
   and ONNX Runtime dynamic int8 (ORT's ``quantize_dynamic`` on ``fxforge.deploy.export_onnx``'s fp32 file)
   when onnxruntime is importable (else said so);
4. accuracy on ``--eval`` held-out reviews (1,000; 128 tokens): fp32, the simulated point, the lowered point
   (target: within 0.5 pt of the simulated point), torch.ao dynamic int8.
Timings on a shared machine are noisy: ``--threads 1`` avoids OpenMP workers waiting for a scheduler slice.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge.benchmarks.minilm_ship import disk_bytes, linear_macs, lower_point, resident_bytes, ship_point  # noqa: E402
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402

TARGETS = {"size": 1 / 8, "latency": 0.45, "accuracy_pt": 0.5}


def cpu_model() -> str:
    """The CPU's model name and the int8-relevant vector extensions it has (from /proc/cpuinfo)."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", "unknown CPU", "x86_64"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    ext = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{name} ({', '.join(ext) or 'no AVX2'})"


def torchao_dynamic(graph: ForgeGraph) -> torch.nn.Module:
    """torch.ao's dynamic int8 (per-tensor activations, per-tensor int8 weights) on a copy of the fp32 graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(graph.model), {torch.nn.Linear},
                                                      dtype=torch.qint8)


def onnxruntime_dynamic(graph: ForgeGraph, workdir: Path) -> Any:
    """An ONNX Runtime session of the fp32 graph quantized by ORT's dynamic int8 (QInt8 weights), or the reason
    there is none. The fp32 ONNX file is fxforge's own artifact (``fxforge.deploy.export_onnx``: torch.onnx's
    dynamo exporter on the inference signature, without ``labels``); the session runs graph optimisation ALL
    on torch's thread count."""
    try:  # imported by name so type checking does not need onnxruntime's stubs
        ort = importlib.import_module("onnxruntime")
        quantization = importlib.import_module("onnxruntime.quantization")
    except ImportError:
        return "onnxruntime is not installed in this environment: skipped"
    from fxforge.deploy import export_onnx

    manifest = export_onnx(graph, workdir / "fp32-onnx", check=False)
    int8 = workdir / "model.int8.onnx"
    quantization.quantize_dynamic(str(workdir / "fp32-onnx" / manifest.artifact), str(int8),
                                  weight_type=quantization.QuantType.QInt8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(int8), opts, providers=["CPUExecutionProvider"])
    names, out = list(manifest.inputs), "logits" if "logits" in manifest.outputs else manifest.outputs[0]
    return lambda **kw: torch.from_numpy(session.run([out], {k: kw[k].numpy() for k in names})[0])


def logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a graph captured with or without ``labels`` (zeros are passed where it takes them)."""
    from fxforge.search.task import logits_of, with_labels

    if isinstance(model, ForgeGraph):
        model = model.model
    if isinstance(model, torch.nn.Module):
        inputs = with_labels(model, inputs, torch.zeros(inputs["input_ids"].shape[0], dtype=torch.long))
    return logits_of(model(**inputs))


@torch.inference_mode()
def accuracy(model: Any, batches: Any) -> float:
    correct = total = 0
    for inputs, labels in batches:
        correct += int((logits(model, inputs).argmax(-1) == labels).sum())
        total += int(labels.numel())
    return correct / total


def fine_tuned(path: Path) -> ForgeGraph:
    """The fp32 fine-tuned classifier at ``path`` (``make demo`` saves it as fxforge-demo/minilm-lora).

    Benchmarks do not reach examples/ (tests/test_imports.py), so a missing checkpoint is refused naming the
    command that makes it rather than fine-tuned here.
    """
    if not (path / "manifest.json").is_file():
        raise SystemExit(f"bench_minilm_lowered: no fine-tuned checkpoint at {path}: run `make demo` first (its "
                         "step 2 saves fxforge-demo/minilm-lora) or pass --model CKPT")
    return ForgeGraph.from_checkpoint(path).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fxforge-demo/minilm-lora", help="fine-tuned fp32 fxforge checkpoint")
    parser.add_argument("--ffn", type=float, default=0.85, help="fraction of FFN units removed (<= 1/8 of fp32's "
                        "bytes needs >= 0.8 with int8 linears and 4-bit embeddings)")
    parser.add_argument("--method", default="taylor", choices=["l1", "taylor"],
                        help="FFN unit importance (taylor: on 64 training reviews)")
    parser.add_argument("--eval", type=int, default=1000, help="held-out reviews for accuracy")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="200 reviews, 7 rounds")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.eval, args.rounds = min(args.eval, 200), min(args.rounds, 7)
    if args.threads:
        torch.set_num_threads(args.threads)
    from fxforge.quiet import quiet
    from fxforge.search import TextClassificationTask

    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}")
    base = fine_tuned(Path(args.model))
    with quiet():
        task = TextClassificationTask("imdb", train_size=256, eval_size=args.eval, max_length=args.length,
                                      eval_batch_size=32, progress=False, calibration_size=64)
    calib = task.calibration(base.model) if args.method == "taylor" else None
    point = ship_point(base, args.ffn, args.method, calib)
    lowered, info = lower_point(point)
    inputs = {k: v[:args.batch] for k, v in task.eval_batches()[0][0].items()}
    if inputs["input_ids"].shape[0] < args.batch:
        raise SystemExit(f"--batch {args.batch} needs at least that many held-out reviews")
    tokens = args.batch * args.length
    mac_ratio = linear_macs(lowered, tokens) / linear_macs(base, tokens)
    print(f"ceiling: the point does {mac_ratio:.2f}x fp32's Linear MACs at {args.batch}x{args.length} "
          f"(compute-bound); its linears run int8 GEMMs ({info.lowered and len(info.lowered)} layers lowered)")

    res: dict[str, Any] = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "ffn": args.ffn,
                           "method": args.method, "batch": args.batch, "length": args.length}
    with tempfile.TemporaryDirectory(prefix="fxforge-bench-") as tmp:
        disk = {"fp32": disk_bytes(base, Path(tmp) / "fp32"), "simulated": disk_bytes(point, Path(tmp) / "sim"),
                "lowered": disk_bytes(lowered, Path(tmp) / "low")}
        resident = {"fp32": resident_bytes(base), "lowered": resident_bytes(lowered)}
        ao = torchao_dynamic(base)
        ort = onnxruntime_dynamic(base, Path(tmp))
        variants: dict[str, Any] = {"fp32": base, "lowered": lowered, "torch.ao dynamic int8": ao}
        if callable(ort):
            variants["onnxruntime dynamic int8"] = ort
        else:
            print(ort)
        with torch.inference_mode():
            times = interleaved({k: functools.partial(logits, m, inputs) for k, m in variants.items()}, args.rounds)
        med = times.medians()
        acc = {"fp32": accuracy(base, task.eval_batches()), "simulated": accuracy(point, task.eval_batches())}
        acc.update({k: accuracy(m, task.eval_batches()) for k, m in variants.items() if k != "fp32"})
    res.update(disk_bytes=disk, resident_bytes=resident, median_ms={k: v * 1e3 for k, v in med.items()},
               accuracy=acc, eval_reviews=len(task.data["test"]), loadavg=os.getloadavg())
    size_disk, size_mem = disk["lowered"] / disk["fp32"], resident["lowered"] / resident["fp32"]
    print(f"\nsize (measured)   {'fp32 MB':>9} {'point MB':>9} {'ratio':>7}  target <= {TARGETS['size']:.3f}")
    print(f"on disk           {disk['fp32'] / 1e6:>9.2f} {disk['lowered'] / 1e6:>9.2f} {size_disk:>7.3f}"
          f"  (simulated point's checkpoint {disk['simulated'] / 1e6:.2f} MB)")
    print(f"resident          {resident['fp32'] / 1e6:>9.2f} {resident['lowered'] / 1e6:>9.2f} {size_mem:>7.3f}"
          "  (parameters + buffers; oneDNN's packed int8 weights are an extra copy)")
    print(f"\n{'variant':<26} {'median ms':>9} {'x fp32':>7} {'pair':>6} {'accuracy':>9}   "
          f"({args.batch}x{args.length}, {args.rounds} rounds; {len(task.data['test'])} reviews)")
    for name in variants:
        pair = times.pair_ratio(name, "fp32")
        print(f"{name:<26} {med[name] * 1e3:>9.1f} {med[name] / med['fp32']:>7.3f} {pair:>6.3f} {acc[name]:>9.3f}")
    print(f"{'simulated point':<26} {'':>9} {'':>7} {'':>6} {acc['simulated']:>9.3f}")
    latency = med["lowered"] / med["fp32"]
    fastest_anchor = min(med[k] for k in variants if k not in ("fp32", "lowered")) / med["fp32"]
    gap = 100 * abs(acc["lowered"] - acc["simulated"])
    checks = {f"size on disk {size_disk:.3f} and resident {size_mem:.3f} <= 1/8":
              size_disk <= TARGETS["size"] and size_mem <= TARGETS["size"],
              f"latency {latency:.3f}x <= {TARGETS['latency']}x fp32": latency <= TARGETS["latency"],
              f"as fast as the fastest anchor ({fastest_anchor:.3f}x)": latency <= fastest_anchor,
              f"lowered vs simulated accuracy {gap:.1f} pt <= {TARGETS['accuracy_pt']}": gap <= TARGETS["accuracy_pt"]}
    print()
    for what, ok in checks.items():
        print(f"{'met   ' if ok else 'MISSED'} {what}")
    res["checks"] = checks
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
