"""Inference time of a LoRA-fused MiniLM graph vs the base graph (and the unfused adapters), one run.

    nohup .venv/bin/python -m fxforge.benchmarks.bench_lora_inference > /tmp/bench_lora_inference.log 2>&1 &

Base, unfused (rank-8 adapters on every Linear but the head) and fused graphs run the same eval batch
in interleaved repetitions whose order rotates; medians are compared. Fusion must give back the base
model's cost: target fused / base <= 1.03.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import functools  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.models.bert import minilm_for_sequence_classification  # noqa: E402
from fxforge.passes.transform.lora import lora_layers  # noqa: E402

HF_NAMES = ["input_ids", "attention_mask", "labels"]
LORA_ARGS = {"rank": 8, "alpha": 16.0, "dropout": 0.1, "trainable": {"name": "classifier"}}  # as the LoRA example


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)

    base = ForgeGraph(minilm_for_sequence_classification(seed=0), hf_input_names=HF_NAMES).eval()
    unfused = ForgeGraph(minilm_for_sequence_classification(seed=0), hf_input_names=HF_NAMES).eval()
    unfused, _ = passes.insert_lora_adapter_transform_pass(unfused, LORA_ARGS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # stand-in for training: non-zero adapters
        for _, _, m in lora_layers(unfused.model):
            m.lora_B.normal_(0.0, 0.01, generator=gen)
    fused, _ = passes.fuse_lora_weights_transform_pass(unfused)  # a new graph: unfused keeps its adapters
    inputs = {"input_ids": torch.randint(1000, 30000, (args.batch, args.seq), generator=gen),
              "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
              "labels": torch.zeros(args.batch, dtype=torch.long)}
    with torch.no_grad():
        diff = (fused(**inputs).logits - unfused(**inputs).logits).abs().max().item()
    with torch.no_grad():
        timings = interleaved({k: functools.partial(g, **inputs) for k, g in
                               (("base", base), ("unfused", unfused), ("fused", fused))}, args.repeats)
    med = timings.medians()
    pair = timings.pair_ratio("fused", "base")
    print(f"MiniLM eval forward, batch {args.batch} x {args.seq}, {args.repeats} interleaved repetitions, "
          f"{torch.get_num_threads()} threads: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()))
    print(f"max |fused - unfused| logits = {diff:.2e}")
    ratio = med["fused"] / med["base"]
    print(f"RATIO inference fused / base = {ratio:.3f} (median pairwise {pair:.3f}; target <= 1.03); "
          f"unfused / base = {med['unfused'] / med['base']:.3f}")
    ok = ratio <= 1.03 and diff <= 1e-4
    print("TARGETS MET" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
