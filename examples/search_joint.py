"""A joint compression search on the fine-tuned MiniLM over IMDb: bits × structured sparsity × LoRA rank.

    .venv/bin/python -m fxforge.examples.search_joint --trials 24

Each trial copies the fine-tuned base graph, prunes FFN units and attention heads (and physically
removes them: the model gets smaller and faster), inserts LoRA adapters of the sampled rank,
fine-tunes briefly to recover, fuses the adapters, then quantizes the weights of the Linear layers
and of the embedding tables to sampled MXINT widths (the tables are half of MiniLM's weights: without
them no configuration gets 8x smaller). Objectives: accuracy, total weight bits and latency; the
constraint: accuracy drops at most one point. Two hand-picked uniform configurations (what the
tutorial would choose: no pruning, every layer at 8 bits, or at 4 bits) are evaluated first for
comparison. The Pareto points are rebuilt from their parameters and exported as fxforge checkpoints.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph  # noqa: E402
from fxforge.examples.search_common import finetuned_minilm, imdb_task  # noqa: E402
from fxforge.search import (  # noqa: E402
    Constraint,
    JointSpace,
    LoRARankSpace,
    MixedPrecisionSpace,
    PruningSpace,
    Search,
    TextClassificationTask,
)

FFN = {"regex": [r".*intermediate\.dense"]}
HEADS = {"regex": [r".*attention\.self\.(query|key|value)"]}
WIDTHS = [3, 4, 6, 8]


def space() -> JointSpace:
    return JointSpace(
        PruningSpace([0.0, 0.25, 0.5, 0.75], groups={"ffn": FFN, "heads": HEADS},
                     granularity={"ffn": "ffn", "heads": "head"}, shrink=True),
        LoRARankSpace([8, 16, 32], targets={"type": ["linear"]}, trainable={"name": ["classifier"]}),
        MixedPrecisionSpace({"mxint": {"width": WIDTHS}}, roles=("weight",), per="type",
                            targets=("linear", "embedding")),
    )


def uniform(width: int) -> dict[str, object]:
    """The hand-picked configuration: nothing pruned, every weight at ``width`` bits, the smallest LoRA."""
    return {"sparsity:ffn": 0.0, "sparsity:heads": 0.0, "lora:rank": 8,
            "linear:mxint:weight_width": width, "embedding:mxint:weight_width": width}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--trial-train-size", type=int, default=None,
                   help="reviews each trial fine-tunes on (default: --train-size)")
    p.add_argument("--run-dir", default="out/search-joint")
    p.add_argument("--timeout", type=float, default=2 * 3600, help="stop after this many seconds")
    p.add_argument("--trial-lr", type=float, default=3e-4, help="learning rate of the trials' LoRA fine-tune")
    p.add_argument("--sampler", default="nsga2")
    p.add_argument("--export", type=int, default=3, help="rebuild and export this many smallest feasible points")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    base = finetuned_minilm(run, imdb_task(args.train_size, args.eval_size))
    # the trials' short fine-tune: LoRA wants a larger step than the base's full fine-tune
    task = imdb_task(args.trial_train_size or args.train_size, args.eval_size, lr=args.trial_lr)
    result = Search(space(), ["accuracy", "weight_bits", "latency_ms"], base=base, task=task, n_trials=args.trials,
                    sampler=args.sampler, constraints=[Constraint("accuracy", max_drop=0.01)], run_dir=run,
                    study_name="joint", resume=args.resume, timeout=args.timeout,
                    enqueue=[uniform(8), uniform(4)]).run()
    print(result.table())
    base_acc, fp32_bits, fp32_ms = (result.baseline[k] for k in ("accuracy", "weight_bits", "latency_ms"))
    for row in result.rows(result.completed()):
        drop = 100 * (row["accuracy"] - base_acc)
        print(f"trial {row['trial']}: accuracy {row['accuracy']:.3f} ({drop:+.1f} points), weights "
              f"{fp32_bits / row['weight_bits']:.1f}x smaller, {fp32_ms / row['latency_ms']:.2f}x faster "
              f"{'(feasible)' if row['feasible'] else ''} {row['params']}")
    result.to_csv(run / "pareto.csv")
    result.to_json(run / "pareto.json")
    result.plots(run / "plots")
    feasible = {r["trial"] for r in result.rows() if r["feasible"]}
    front = [t for t in result.front() if t.number in feasible]
    chosen = sorted(front, key=lambda t: t.values[1])[: args.export]  # the smallest feasible points
    paths = result.export(run / "pareto", chosen)  # rebuilt from their parameters (fine-tune replayed)
    print(f"exported: {[str(p) for p in paths]}")
    if paths:
        remeasure(base, task, paths, [t.values[0] for t in chosen])
    return 0


def remeasure(base: ForgeGraph, task: TextClassificationTask, paths: list[Path], accuracies: list[float]) -> None:
    """Reload each exported point, check its accuracy, and time it against the fp32 base interleaved in one run
    (the search measured latency trial by trial, while the machine's load changed)."""
    from fxforge.benchmarks.timing import interleaved
    from fxforge.search.objectives import weight_bits
    from fxforge.search.task import with_labels

    graphs = {"fp32": base, **{p.name: ForgeGraph.from_checkpoint(p).eval() for p in paths}}
    inputs, labels = task.eval_batches()[0]

    def forward(g: ForgeGraph) -> None:
        with torch.no_grad():
            g.model(**with_labels(g.model, inputs, labels))

    t = interleaved({name: (lambda g=g: forward(g)) for name, g in graphs.items()}, repeats=7)
    base_acc, base_bits = task.accuracy(base), weight_bits(base)
    print(f"re-measured, interleaved (batch {labels.numel()} x {task.max_length}): "
          f"fp32 {1e3 * t.median('fp32'):.0f} ms, accuracy {base_acc:.3f}")
    for (name, g), searched in zip(list(graphs.items())[1:], accuracies):
        acc = task.accuracy(g)
        print(f"  {name}: accuracy {acc:.3f} (search: {searched:.3f}; {100 * (acc - base_acc):+.1f} points), "
              f"weights {base_bits / weight_bits(g):.2f}x smaller, {t.pair_ratio('fp32', name):.2f}x faster")


if __name__ == "__main__":
    raise SystemExit(main())
