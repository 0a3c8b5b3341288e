"""Forward+backward time of the GPT with AFNO vs attention mixers at growing sequence lengths.

Run: ``python -m fxforge.benchmarks.bench_afno_vs_attn``. Same size for every mixer (n_embd 256, 4 layers,
4 heads, byte vocabulary); each cell is the median of ``--repeats`` timed steps after one warm-up round,
the mixers alternating within each round, all from a single run. Ratios are AFNO time / attention time
(< 1 means AFNO is faster).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn

from ..models.gpt import GPT, GPTConfig, lm_loss
from .timing import interleaved

MIXERS = (("attn", "causal"), ("afno", "causal"), ("afno", "pad2n"))


def fwd_bwd_seconds(model: nn.Module, idx: torch.Tensor) -> float:
    """Seconds of one forward + backward of the LM loss on ``idx``."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    lm_loss(model(idx), idx).backward()
    return time.perf_counter() - t0


def time_interleaved(models: dict[str, GPT], batch: int, length: int, repeats: int) -> dict[str, float]:
    """Median fwd+bwd seconds per model; models alternate within each round so load drift hits all alike."""
    vocab = next(iter(models.values())).config.vocab_size
    idx = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    variants = {name: (lambda m=model: fwd_bwd_seconds(m, idx)) for name, model in models.items()}
    return interleaved(variants, repeats, warmup=1).medians()


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    """Time every mixer at every length; print a table with AFNO/attention ratios."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    results: dict[tuple[str, int], float] = {}
    print(f"GPT n_embd={args.n_embd} n_layer={args.n_layer} n_head={args.n_head} batch={args.batch_size}, "
          f"fwd+bwd median of {args.repeats}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    for length in args.lengths:
        models = {}
        for mixer, causality in MIXERS:
            torch.manual_seed(0)
            config = GPTConfig(vocab_size=256, sequence_length=length, n_layer=args.n_layer, n_head=args.n_head,
                               n_embd=args.n_embd, mixer=mixer, afno_causality=causality)
            models["attn" if mixer == "attn" else f"afno-{causality}"] = GPT(config)
        for name, seconds in time_interleaved(models, args.batch_size, length, args.repeats).items():
            results[(name, length)] = seconds
            print(f"  T={length:5d}  {name:12s} {seconds * 1000:9.1f} ms", flush=True)
    print("\n   T   attn ms  afno-causal ms  ratio  afno-pad2n ms  ratio")
    for length in args.lengths:
        attn = results[("attn", length)]
        causal, pad = results[("afno-causal", length)], results[("afno-pad2n", length)]
        print(f"{length:5d} {attn * 1000:9.1f} {causal * 1000:15.1f} {causal / attn:6.2f} "
              f"{pad * 1000:14.1f} {pad / attn:6.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.2f} (other processes skew absolute times)")
    return results


if __name__ == "__main__":
    main()
