"""Forward+backward time of the GPT with AFNO vs attention mixers at growing sequence lengths.

Run: ``python -m fxforge.benchmarks.bench_afno_vs_attn``. Same size for every mixer (n_embd 256, 4 layers,
4 heads, byte vocabulary); each cell is the median of ``--repeats`` timed steps after one warm-up step,
from a single run. Ratios are AFNO time / attention time (< 1 means AFNO is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..models.gpt import GPT, GPTConfig, lm_loss

MIXERS = (("attn", "causal"), ("afno", "causal"), ("afno", "pad2n"))


def time_fwd_bwd(model: GPT, batch: int, length: int, repeats: int) -> float:
    """Median seconds of one forward+backward (loss on random bytes) after a warm-up step."""
    if repeats <= 0:
        raise ValueError("repeats must be positive")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        lm_loss(model(idx), idx).backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
          f"fwd+bwd median of {args.repeats}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    for length in args.lengths:
        for mixer, causality in MIXERS:
            torch.manual_seed(0)
            config = GPTConfig(vocab_size=256, sequence_length=length, n_layer=args.n_layer, n_head=args.n_head,
                               n_embd=args.n_embd, mixer=mixer, afno_causality=causality)
            model = GPT(config)
            name = "attn" if mixer == "attn" else f"afno-{causality}"
            results[(name, length)] = time_fwd_bwd(model, args.batch_size, length, args.repeats)
            print(f"  T={length:5d}  {name:12s} {results[(name, length)] * 1000:9.1f} ms", flush=True)
    print("\n   T   attn ms  afno-causal ms  ratio  afno-pad2n ms  ratio")
    for length in args.lengths:
        attn = results[("attn", length)]
        causal, pad = results[("afno-causal", length)], results[("afno-pad2n", length)]
        print(f"{length:5d} {attn * 1000:9.1f} {causal * 1000:15.1f} {causal / attn:6.2f} "
              f"{pad * 1000:14.1f} {pad / attn:6.2f}")
    return results


if __name__ == "__main__":
    main()
