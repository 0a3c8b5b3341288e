"""Cost of the shape guard per call, as a ratio to one forward of the same graph (tiny BERT, A-GRU).

The guard (graph/guards.check_input_shapes) runs on every call of an export-captured graph; this times
it alone with the graph's real arguments and divides by the median forward time, measured in one run.

    .venv/bin/python -m fxforge.benchmarks.bench_guards [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402
from fxforge.graph.guards import GUARD_NODE  # noqa: E402


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def guard_ratio(mg: ForgeGraph, inputs: dict[str, torch.Tensor], rounds: int) -> tuple[float, float]:
    """(guard seconds, forward seconds): medians over ``rounds`` calls (inputs in placeholder order)."""
    node = next(n for n in mg.nodes if n.name == GUARD_NODE)
    args, check = tuple(inputs.values()), node.target
    if not callable(check):
        raise TypeError(f"{GUARD_NODE} calls {check!r}, not a function: is the graph captured with guards?")
    with torch.inference_mode():
        guard = median_seconds(lambda: check(*args, **node.kwargs), rounds)
        forward = median_seconds(lambda: mg(**inputs), rounds)
    return guard, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    from fxforge.models.agru import AGRUClassifier
    from fxforge.models.bert import tiny_bert

    torch.manual_seed(0)
    bert = tiny_bert(num_hidden_layers=2, max_position_embeddings=64).eval()
    ids = torch.randint(0, int(bert.config.vocab_size), (8, 32))
    mask = torch.ones(8, 32, dtype=torch.long)
    bert_graph = ForgeGraph(bert, {"input_ids": ids, "attention_mask": mask}).eval()
    agru = AGRUClassifier(input_size=8, hidden_size=16, num_layers=2, num_classes=10).eval()
    x = torch.randn(8, 12, 8)
    agru_graph = ForgeGraph(agru, x).eval()
    for name, mg, inputs in (("tiny BERT b8 s32", bert_graph, {"input_ids": ids, "attention_mask": mask}),
                              ("A-GRU b8 T12", agru_graph, {"x": x})):
        guard, forward = guard_ratio(mg, inputs, args.rounds)
        print(f"{name}: guard {guard * 1e6:.1f} us per call, forward {forward * 1e3:.2f} ms -> guard/forward "
              f"= {guard / forward:.1e} (medians of {args.rounds} calls)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
