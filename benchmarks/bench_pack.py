"""How long exporting a packed checkpoint takes: MiniLM with 4-bit fixed-point linears and embeddings.

    .venv/bin/python -m fxforge.benchmarks.bench_pack [--quick] [--threads 1] [--rounds N] [--profile]
        [--format int4|scaled8|mxint4|fp8] [--model minilm|tiny]

The search measures ``checkpoint_bytes`` by exporting every trial, so export time is search time (and
``make demo`` time). Printed, in one run: the CPU, threads and load average; then the export of the
quantized MiniLM (22.7M parameters, all weights of its linears and embeddings stored as 4-bit codes) split
into its steps, each measured inside the same export call (medians over rounds):

* ``packing``   -- every quantized weight packed (``plan_packing``: quantize, codes, bit streams, the unpack check);
* ``reference`` -- the reference outputs recorded for ``fxforge verify`` (one forward on the example inputs);
* ``export``    -- the whole ``ForgeGraph.export`` (packing + reference + writing);
* ``writing``   -- the rest of the export (nodes and metadata JSON, safetensors bytes, the atomic write);
* ``export CPU`` -- the process's CPU time during the export (all threads; less sensitive to load than wall time).

``--profile`` adds a cProfile of one export (top functions by cumulative time). Timings on a shared machine
are noisy: compare runs taken under the same load, and read the load average printed first.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402

HF_NAMES = ["input_ids", "attention_mask", "labels"]
TARGET_S = 3.0  # packed MiniLM export on a quiet machine (issue 28: the search exports every trial)


def cpu_line() -> str:
    """The CPU model, torch's thread count and the 1-minute load average."""
    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{name}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average {load:.2f}"


# --format: the weights' format, as the quantize pass's flat config (weights only)
FORMATS: dict[str, dict[str, Any]] = {
    "int4": {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"},
    "scaled8": {"name": "scaled_integer", "weight_width": 8, "weight_granularity": "per_channel"},
    "mxint4": {"name": "mxint", "weight_width": 4, "weight_block_size": 32},
    "fp8": {"name": "minifloat", "weight_width": 8, "weight_exponent_width": 4, "weight_special": "fn"},
}


def quantized_model(model: str, fmt: str = "int4") -> ForgeGraph:
    """MiniLM (or tiny BERT) with every linear and embedding weight in ``fmt`` (default: 4-bit fixed point,
    frac_width auto, as the search's 4-bit points quantize them)."""
    from fxforge import passes

    if model == "minilm":
        from fxforge.models.bert import minilm_for_sequence_classification
        net = minilm_for_sequence_classification().eval()
    else:
        from fxforge.models.bert import tiny_bert
        net = tiny_bert().eval()
    mg = ForgeGraph(net, hf_input_names=HF_NAMES).eval()
    spec = FORMATS[fmt]
    config = {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": spec},
              "embedding": {"config": spec}}
    mg, _ = passes.quantize_transform_pass(mg, config)
    return mg


class TimedExport:
    """``mg.export`` with the time spent in packing and reference outputs measured inside the same call (the
    checkpoint module's ``plan_packing`` and ``outputs_of`` wrapped while it runs), so the split adds up."""

    def __init__(self, mg: ForgeGraph, workdir: Path) -> None:
        self.mg, self.workdir, self.calls = mg, workdir, 0
        self.split: dict[str, list[float]] = {"packing": [], "reference": [], "writing": [], "export": [],
                                              "export CPU": []}

    def __call__(self) -> float:
        from fxforge.graph import checkpoint

        spent = {"packing": 0.0, "reference": 0.0}

        def timed(name: str, fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[name] += time.perf_counter() - start
            return run

        originals = checkpoint.plan_packing, checkpoint.outputs_of
        checkpoint.plan_packing = timed("packing", originals[0])
        checkpoint.outputs_of = timed("reference", originals[1])
        try:
            start, cpu = time.perf_counter(), time.process_time()
            self.mg.export(self.workdir / f"ckpt{self.calls % 2}")
            total, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            checkpoint.plan_packing, checkpoint.outputs_of = originals
        self.calls += 1
        for name, value in (*spent.items(), ("writing", total - sum(spent.values())), ("export", total),
                            ("export CPU", cpu)):
            self.split[name].append(value)
        return total


def profile(mg: ForgeGraph, workdir: Path, top: int = 25) -> str:
    """cProfile of one export: the ``top`` functions by cumulative time."""
    prof = cProfile.Profile()
    prof.runcall(mg.export, workdir / "profiled")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm", choices=["minilm", "tiny"])
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS), help="the weights' format")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 warm-up")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of one export")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, warmup = (2, 1) if args.quick else (args.rounds, 1)
    print(f"CPU: {cpu_line()}")
    start = time.perf_counter()
    mg = quantized_model(args.model, args.format)
    n = sum(p.numel() for p in mg.model.parameters())
    print(f"{args.model}: {n / 1e6:.1f}M parameters, linears + embeddings in {args.format} {FORMATS[args.format]} "
          f"(built in {time.perf_counter() - start:.1f} s)")
    with tempfile.TemporaryDirectory(prefix="fxforge-bench-pack-") as tmp:
        work = Path(tmp)
        run = TimedExport(mg, work)
        interleaved({"export": run}, rounds, warmup)
        size = (work / "ckpt0" / "weights.safetensors").stat().st_size
        print(f"weights.safetensors: {size / 1e6:.2f} MB (fp32: {4 * n / 1e6:.1f} MB)")
        print(f"export, median of {rounds} rounds after {warmup} warm-up (s); each round's split measured inside it:")
        for name, values in run.split.items():
            values = values[warmup:]
            print(f"  {name:<10} {statistics.median(values):7.3f}   ({', '.join(f'{v:.2f}' for v in values)})")
        print(f"  target: export <= {TARGET_S:.1f} s on a quiet machine")
        if args.profile:
            print(profile(mg, work))
    print(f"CPU after: {cpu_line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
