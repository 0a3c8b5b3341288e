"""Int8 weight-only GEMV at decode: fxforge's C++ kernel vs fp32 / bf16 F.linear and ATen's _weight_int8pack_mm.

Shapes are the linears of a 134M Llama (hidden 768, intermediate 2048, vocab 32000) at 1..8 rows.
Each variant cycles through copies of its weights totalling >= 2x the L3 cache, so every call
streams its weights from DRAM as a decode step does (one copy would sit in L2/L3 and flatter the
small shapes). Variants run interleaved (benchmarks/timing.py); medians, ratios to fp32 F.linear.
The ceiling printed first: weight bytes per call over the measured read bandwidth. The last table
weights the shapes by how often a decode step runs them (12 layers x q/k/v/o, gate/up, down + the head).

    .venv/bin/python -m fxforge.benchmarks.bench_woq_int8 [--quick] [--rows 1 8] [--repeats 31] [--threads N]
        [--compile]

On a machine loaded by other processes, a 2-thread call whose OpenMP worker has gone to sleep can wait a
whole scheduler slice (~25 ms measured here with load 11 on 2 cores) for it: medians then show the load,
not the kernels; ``--threads 1`` or a quiet machine shows the kernels.

``--compile`` adds Inductor's weight-only int8 path (``torch.compile`` of ``F.linear(x, w.to(x.dtype)) * scale``,
the pattern its int8 weight-only lowering matches; ~30 s to compile per shape).
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fxforge.benchmarks.timing import interleaved
from fxforge.kernels import woq_int8 as W

SHAPES = [(768, 768), (768, 2048), (2048, 768), (768, 32000)]  # (K, N)
PER_STEP = {(768, 768): 48, (768, 2048): 24, (2048, 768): 12, (768, 32000): 1}  # calls per decode step


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform's answer elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    """The last-level cache size (sysfs), 32 MiB if unknown."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 32 << 20


def read_bandwidth(mb: int = 512, repeats: int = 7) -> float:
    """Bytes/s of a multi-threaded sum over a tensor far larger than the caches (median of repeats)."""
    t = torch.ones(mb << 18)  # mb MiB of fp32
    times = interleaved({"sum": lambda: t.sum()}, repeats, warmup=1).times["sum"]
    return t.numel() * 4 / statistics.median(times)


def cycling(fn: Callable[[Any], Any], copies: list[Any]) -> Callable[[], Any]:
    """A zero-argument callable running ``fn`` on the next copy each call."""
    state = {"i": 0}

    def run() -> Any:
        state["i"] = (state["i"] + 1) % len(copies)
        return fn(copies[state["i"]])

    return run


def replicate(make: Callable[[], Any], nbytes: int, target: int) -> list[Any]:
    """Enough fresh copies (``make()``) of an ``nbytes`` weight set to cover ``target`` bytes."""
    return [make() for _ in range(max(1, math.ceil(target / nbytes)))]


def variants_for(m: int, k: int, n: int, target: int, compile_: bool) -> dict[str, Callable[[], Any]]:
    """The timed callables for one shape: each owns its weight copies and a fixed input."""
    gen = torch.Generator().manual_seed(k * 7 + n)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=gen)
    w32 = w8.float() * scale[:, None]
    xb = x.bfloat16()
    int8s = replicate(lambda: (w8.clone(), scale.clone()), n * k, target)
    out: dict[str, Callable[[], Any]] = {
        "fp32 F.linear": cycling(lambda w: F.linear(x, w), replicate(w32.clone, n * k * 4, target)),
        "bf16 F.linear": cycling(lambda w: F.linear(xb, w), replicate(lambda: w32.bfloat16(), n * k * 2, target)),
        "aten int8pack": cycling(lambda p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1]), int8s),
        "fxforge int8": cycling(lambda p: W.int8_weight_only_linear(x, p[0], p[1]), int8s),
    }
    if compile_:
        fn = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s, dynamic=False)
        out["inductor int8"] = cycling(lambda p: fn(x, p[0], p[1]), int8s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="rows 1 only, 15 repeats")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--compile", action="store_true", help="add Inductor's weight-only int8 (torch.compile)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads for every variant (0: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, repeats = ([1], 15) if args.quick else (args.rows, args.repeats)
    if W.native_library() is None:
        print("WARNING: the C++ kernel is unavailable here: 'fxforge int8' runs ATen's reference")
    bw = read_bandwidth()
    target = 2 * l3_bytes()
    print(f"CPU: {cpu_model()} | torch {torch.__version__} vector ISA {torch.backends.cpu.get_cpu_capability()} | "
          f"threads {torch.get_num_threads()} | read bandwidth {bw / 1e9:.1f} GB/s (sum of 512 MiB fp32) | "
          f"weights cycled over >= {target >> 20} MiB per variant | {repeats} interleaved repeats, medians")
    totals: dict[tuple[int, str], dict[str, float]] = {}
    with torch.inference_mode():
        for m in rows:
            print(f"\n-- {m} row(s): median us (ratio to fp32 F.linear), best us (ratio: the figure least hit by load)")
            for k, n in SHAPES:
                start = time.perf_counter()
                t = interleaved(variants_for(m, k, n, target, args.compile), repeats, warmup=3)
                print(f"K={k} N={n}: floors fp32 {n * k * 4 / bw * 1e6:.0f} us, int8 {n * k / bw * 1e6:.0f} us "
                      f"(0.25)  [{time.perf_counter() - start:.0f} s]")
                med, best = t.medians(), {name: min(ts) for name, ts in t.times.items()}
                for name in med:
                    print(f"  {name:15s} {med[name] * 1e6:9.0f} ({med[name] / med['fp32 F.linear']:.2f})"
                          f" {best[name] * 1e6:9.0f} ({best[name] / best['fp32 F.linear']:.2f})")
                    for stat, v in (("median", med[name]), ("best", best[name])):
                        per = totals.setdefault((m, stat), {})
                        per[name] = per.get(name, 0.0) + v * PER_STEP[(k, n)]
                print(flush=True, end="")
    wbytes = sum(n * k * c for (k, n), c in PER_STEP.items())
    print(f"\n-- a 134M Llama decode step's linears ({sum(PER_STEP.values())} calls, {wbytes / 1e6:.0f} M weights): "
          f"per-shape times x calls; floors fp32 {wbytes * 4 / bw * 1e3:.1f} ms, int8 {wbytes / bw * 1e3:.1f} ms")
    for (m, stat), per in totals.items():
        base = per["fp32 F.linear"]
        cells = "  ".join(f"{name} {v * 1e3:.1f} ms ({v / base:.2f})" for name, v in per.items())
        print(f"{m} row(s), {stat:6s}: {cells}")


if __name__ == "__main__":
    main()
