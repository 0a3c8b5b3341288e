"""torch.compile of the AFNO GPT after afno_real_arithmetic_transform_pass vs eager AFNO and attention.

Run: ``python -m fxforge.benchmarks.bench_afno_compile`` (CPU is fine; ~30 s of compilation per compiled
model and length, so run it once). fwd+bwd of the LM loss, seq 1024 and 4096 by default; every model is
timed in the same rounds (interleaved, after a warm-up round that also compiles), medians, one run.
Ratios are against eager AFNO (target: real-arithmetic compiled <= 0.8x) and eager attention.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph
from ..models.gpt import GPT, GPTConfig
from ..passes.analysis.metadata import add_common_metadata_analysis_pass, init_metadata_analysis_pass
from ..passes.transform.afno_real import afno_real_arithmetic_transform_pass
from .bench_afno_vs_attn import fwd_bwd_seconds


def build(length: int, args: argparse.Namespace) -> dict[str, nn.Module]:
    """The variants at one length: eager AFNO, compiled AFNO (as is / real arithmetic), eager attention."""
    def gpt(mixer: str) -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=256, sequence_length=length, n_layer=args.n_layer, n_head=args.n_head,
                             n_embd=args.n_embd, mixer=mixer))

    afno = gpt("afno")
    idx = torch.randint(0, 256, (args.batch_size, length))
    mg = ForgeGraph(gpt("afno"), example_inputs=idx, frontend="fx")
    mg, _ = init_metadata_analysis_pass(mg)
    mg, _ = add_common_metadata_analysis_pass(mg)
    mg, info = afno_real_arithmetic_transform_pass(mg)
    assert info.rewritten == args.n_layer and set(info.complex_ops_after) <= {"fft_rfft", "fft_irfft"}
    return {
        "afno-eager": afno,
        "afno-compiled": torch.compile(gpt("afno"), dynamic=False),
        "afno-real-compiled": torch.compile(mg.model, dynamic=False),
        "attn-eager": gpt("attn"),
    }


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"GPT n_embd={args.n_embd} n_layer={args.n_layer} batch={args.batch_size}, fwd+bwd median of "
          f"{args.repeats}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[tuple[str, int], float] = {}
    for length in args.lengths:
        models = build(length, args)
        idx = torch.randint(0, 256, (args.batch_size, length), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {name: [] for name in models}
        for round_ in range(args.repeats + 1):  # round 0 warms up (and compiles)
            for name, model in models.items():
                seconds = fwd_bwd_seconds(model, idx)  # type: ignore[arg-type]
                if round_:
                    times[name].append(seconds)
        for name, ts in times.items():
            results[(name, length)] = statistics.median(ts)
            print(f"  T={length:5d} {name:20s} {results[(name, length)] * 1000:9.1f} ms", flush=True)
    print("\n    T  afno-compiled/eager  afno-real-compiled/eager  afno-real-compiled/attn-eager  afno-eager/attn")
    for length in args.lengths:
        r = {name: results[(name, length)] for name in ("afno-eager", "afno-compiled", "afno-real-compiled",
                                                          "attn-eager")}
        print(f"{length:6d} {r['afno-compiled'] / r['afno-eager']:20.2f} "
              f"{r['afno-real-compiled'] / r['afno-eager']:25.2f} "
              f"{r['afno-real-compiled'] / r['attn-eager']:30.2f} {r['afno-eager'] / r['attn-eager']:16.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.2f} (other processes skew absolute times)")
    return results


if __name__ == "__main__":
    main()
