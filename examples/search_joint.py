"""A joint compression search on the fine-tuned MiniLM over IMDb: bits × structured sparsity × LoRA rank.

    .venv/bin/python -m fxforge.examples.search_joint --trials 24

Each trial copies the fine-tuned base graph, prunes FFN units and attention heads (and physically
removes them), inserts LoRA adapters of the sampled rank, fine-tunes briefly to recover, fuses the
adapters, then quantizes each Linear type to the sampled format: fixed point (smaller, simulated) or
scaled int8 lowered to real int8 kernels (faster). Objectives: accuracy, total weight bits and
latency; the constraint: accuracy drops at most one point. The Pareto points are rebuilt from their
parameters and exported as fxforge checkpoints.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from fxforge.examples.search_common import finetuned_minilm, imdb_task  # noqa: E402
from fxforge.search import (  # noqa: E402
    Constraint,
    JointSpace,
    LoRARankSpace,
    MixedPrecisionSpace,
    PruningSpace,
    Search,
)

FFN = {"regex": [r".*intermediate\.dense"]}
HEADS = {"regex": [r".*attention\.self\.(query|key|value)"]}


def space() -> JointSpace:
    return JointSpace(
        PruningSpace([0.0, 0.25, 0.5], groups={"ffn": FFN}, granularity="ffn", shrink=True),
        LoRARankSpace([4, 8, 16], targets={"type": ["linear"]}, trainable={"name": ["classifier"]}),
        MixedPrecisionSpace({"integer": {"width": [4, 6, 8], "frac_width": [2, 3, 4]},
                             "scaled_integer": {"width": [8], "granularity": ["per_channel"]}},
                            roles=("weight", "data_in"), per="type", calibrate=True, lower_int8=True),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--run-dir", default="out/search-joint")
    p.add_argument("--timeout", type=float, default=2 * 3600, help="stop after this many seconds")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    task = imdb_task(args.train_size, args.eval_size)
    base = finetuned_minilm(run, task)
    result = Search(space(), ["accuracy", "weight_bits", "latency_ms"], base=base, task=task, n_trials=args.trials,
                    sampler="nsga2", constraints=[Constraint("accuracy", max_drop=0.01)], run_dir=run,
                    study_name="joint", resume=args.resume, timeout=args.timeout).run()
    print(result.table())
    fp32_bits = result.baseline["weight_bits"]
    fp32_ms = result.baseline["latency_ms"]
    for row in result.rows():
        drop = 100 * (row["accuracy"] - result.baseline["accuracy"])
        print(f"trial {row['trial']}: accuracy {row['accuracy']:.3f} ({drop:+.1f} points), weights "
              f"{fp32_bits / row['weight_bits']:.1f}x smaller, {fp32_ms / row['latency_ms']:.2f}x faster")
    result.to_csv(run / "pareto.csv")
    result.plots(run / "plots")
    print(f"exported: {[str(p) for p in result.export(run / 'pareto')]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
