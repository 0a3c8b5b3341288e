"""torch.compile of the AFNO GPT after afno_real_arithmetic_transform_pass vs eager AFNO and attention.

Run: ``python -m fxforge.benchmarks.bench_afno_compile`` (CPU is fine; ~30-60 s of compilation per compiled
model and length, so run it once). fwd+bwd of the LM loss, seq 1024 and 4096 by default; every model is
timed in the same rounds (benchmarks/timing.py: interleaved, order rotating, after warm-up rounds that also
compile), medians of one run, torch threads fixed (``--threads``). Ratios are against eager AFNO (target:
real-arithmetic compiled <= 0.8x) and eager attention; ``pair`` is the median of per-round ratios.

``gemm`` is the share of eager AFNO's fwd+bwd spent in matrix multiplies (``aten::mm``/``bmm``/``addmm``;
the fastest of three profiled steps). ``floor`` is the time the compiled real-arithmetic step spends in
matrix multiplies and FFTs (likewise) over the eager median: Inductor calls the same MKL routines for both, so no
compilation of this model reaches a ratio below ``floor`` plus whatever its fused kernels cost
(``kernels``: the rest of the compiled step, same units; not printed with ``--cpp-wrapper``, whose
compiled code calls MKL out of the profiler's sight). ``--mode`` passes a torch.compile mode (e.g.
``max-autotune-no-cudagraphs``) to both compiled variants. The real-arithmetic variant also runs
mask_free_activations_transform_pass (``--no-mask-free`` leaves it out).
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from ..graph.forge_graph import ForgeGraph
from ..models.gpt import GPT, GPTConfig
from ..passes.analysis.metadata import add_common_metadata_analysis_pass, init_metadata_analysis_pass
from ..passes.transform.afno_real import afno_real_arithmetic_transform_pass
from ..passes.transform.mask_free import mask_free_activations_transform_pass
from .bench_afno_vs_attn import fwd_bwd_seconds
from .timing import interleaved

GEMM_OPS = frozenset({"aten::mm", "aten::bmm", "aten::addmm"})
FFT_OPS = frozenset({"aten::_fft_r2c", "aten::_fft_c2r", "aten::_fft_c2c"})


def build(length: int, args: argparse.Namespace) -> dict[str, nn.Module]:
    """The variants at one length: eager AFNO, compiled AFNO (as is / real arithmetic), eager attention."""
    def gpt(mixer: str) -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=256, sequence_length=length, n_layer=args.n_layer, n_head=args.n_head,
                             n_embd=args.n_embd, mixer=mixer))

    idx = torch.randint(0, 256, (args.batch_size, length))
    mg = ForgeGraph(gpt("afno"), example_inputs=idx, frontend="fx")
    mg, _ = init_metadata_analysis_pass(mg)
    mg, _ = add_common_metadata_analysis_pass(mg)
    mg, info = afno_real_arithmetic_transform_pass(mg)
    assert info.rewritten == info.fft_convs == args.n_layer and not info.complex_ops_after, info
    if args.mask_free:
        mg, masks = mask_free_activations_transform_pass(mg)
        assert masks.rewritten == {"relu": args.n_layer, "softshrink": args.n_layer}, masks
    return {
        "afno-eager": gpt("afno"),
        "afno-compiled": compiled_module(gpt("afno"), args.mode),
        "afno-real-compiled": compiled_module(mg.model, args.mode),
        "attn-eager": gpt("attn"),
    }


def compiled_module(model: nn.Module, mode: str) -> nn.Module:
    """``torch.compile(model)``: an OptimizedModule, an nn.Module (torch annotates the result as a Callable)."""
    compiled = torch.compile(model, dynamic=False, mode=mode)
    if not isinstance(compiled, nn.Module):
        raise TypeError(f"torch.compile returned a {type(compiled).__name__} for a module, not an nn.Module")
    return compiled


def split_step(model: nn.Module, idx: torch.Tensor, steps: int = 3) -> dict[str, float]:
    """Seconds of a profiled fwd+bwd spent in matrix multiplies, in FFTs, and in total: the fastest of
    ``steps`` profiled steps (a step slowed by other load would overstate every part)."""
    return min((_split_one_step(model, idx) for _ in range(steps)), key=lambda parts: parts["total"])


def _split_one_step(model: nn.Module, idx: torch.Tensor) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd_seconds(model, idx)
    events = prof.key_averages()
    parts = {"gemm": 0.0, "fft": 0.0, "total": 0.0}
    for e in events:
        seconds = e.self_cpu_time_total / 1e6
        parts["total"] += seconds
        if e.key in GEMM_OPS:
            parts["gemm"] += seconds
        elif e.key in FFT_OPS:
            parts["fft"] += seconds
    return parts


def cpu_steal(stat_path: str = "/proc/stat") -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs so far (Linux /proc/stat; (0, 0) elsewhere): time the hypervisor
    gave to other guests, which slows every variant of a round alike but inflates absolute times."""
    try:
        with open(stat_path) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (the first compiles)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--mode", default=None, help="torch.compile mode (default: torch's default mode)")
    p.add_argument("--no-mask-free", dest="mask_free", action="store_false",
                   help="compile the real-arithmetic graph without mask_free_activations_transform_pass")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="Inductor's C++ wrapper (no Python between the compiled kernels) for both compiled variants")
    args = p.parse_args(argv)
    if args.cpp_wrapper:
        import torch._inductor.config as inductor_config

        inductor_config.cpp_wrapper = True
    if args.threads <= 0 or args.repeats <= 0 or args.warmup <= 0:
        raise SystemExit("--threads, --repeats and --warmup must be positive")
    torch.set_num_threads(args.threads)
    print(f"GPT n_embd={args.n_embd} n_layer={args.n_layer} batch={args.batch_size}, fwd+bwd median of "
          f"{args.repeats} (+{args.warmup} warm-up), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"compile mode {args.mode or 'default'}{', cpp wrapper' if args.cpp_wrapper else ''}, "
          f"mask-free activations {'on' if args.mask_free else 'off'}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    steal_start = cpu_steal()
    results: dict[tuple[str, int], float] = {}
    pairs: dict[int, float] = {}
    gemm: dict[int, float] = {}
    compiled: dict[int, dict[str, float]] = {}
    for length in args.lengths:
        models = build(length, args)
        idx = torch.randint(0, 256, (args.batch_size, length), generator=torch.Generator().manual_seed(0))
        timings = interleaved({name: functools.partial(fwd_bwd_seconds, model, idx)
                               for name, model in models.items()}, args.repeats, warmup=args.warmup)
        for name, seconds in timings.medians().items():
            results[(name, length)] = seconds
            print(f"  T={length:5d} {name:20s} {seconds * 1000:9.1f} ms", flush=True)
        pairs[length] = timings.pair_ratio("afno-real-compiled", "afno-eager")
        eager = split_step(models["afno-eager"], idx)
        gemm[length] = eager["gemm"] / eager["total"]
        if args.cpp_wrapper:  # the C++ wrapper calls MKL without the profiler's hooks: no split to print
            continue
        compiled[length] = split_step(models["afno-real-compiled"], idx)
        c = {part: seconds * 1000 for part, seconds in compiled[length].items()}
        print(f"  T={length:5d} afno-real-compiled, fastest of 3 profiled steps: matrix multiplies {c['gemm']:.1f} "
              f"ms, FFTs {c['fft']:.1f} ms, the rest {c['total'] - c['gemm'] - c['fft']:.1f} ms", flush=True)
    print("\n    T  afno-compiled/eager  afno-real-compiled/eager (pair)  afno-real-compiled/attn-eager  "
          "afno-eager/attn  gemm  floor  kernels")
    for length in args.lengths:
        r = {name: results[(name, length)] for name in ("afno-eager", "afno-compiled", "afno-real-compiled",
                                                          "attn-eager")}
        split = compiled.get(length)
        floor = f"{(split['gemm'] + split['fft']) / r['afno-eager']:6.2f}" if split else "   n/a"
        kernels = f"{(split['total'] - split['gemm'] - split['fft']) / r['afno-eager']:8.2f}" if split else "     n/a"
        print(f"{length:6d} {r['afno-compiled'] / r['afno-eager']:20.2f} "
              f"{r['afno-real-compiled'] / r['afno-eager']:25.2f} ({pairs[length]:.2f}) "
              f"{r['afno-real-compiled'] / r['attn-eager']:30.2f} {r['afno-eager'] / r['attn-eager']:16.2f} "
              f"{gemm[length]:5.2f} {floor} {kernels}")
    steal, total = (end - start for end, start in zip(cpu_steal(), steal_start))
    print(f"load average at the end {os.getloadavg()[0]:.2f}, CPU time stolen by the hypervisor during the run "
          f"{100 * steal / max(total, 1):.1f}% (other processes skew absolute times)")
    return results


if __name__ == "__main__":
    main()
