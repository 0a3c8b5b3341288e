"""What the transform rule costs on MiniLM: one ``mg.copy()`` vs one quantize pass, in place and as called.

    .venv/bin/python -m fxforge.benchmarks.bench_transform_copy

A transform called as ``pass(mg, args)`` runs on ``mg.copy()`` (its input stays unchanged); pipelines and
search trials own their graph and use ``pass.apply_inplace``. Prints medians of ``--repeats`` runs of the
copy, of the in-place quantize pass, and of the pass as users call it (copy + quantize).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph  # noqa: E402
from fxforge.models.bert import minilm_for_sequence_classification  # noqa: E402
from fxforge.passes.quantize import quantize_transform_pass  # noqa: E402

FIXED8 = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                              "weight_width": 8, "weight_frac_width": 6}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    model = minilm_for_sequence_classification(num_labels=2, seed=0).eval()
    base = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    times: dict[str, list[float]] = {"copy": [], "quantize in place": [], "quantize (copy + pass)": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        graph = base.copy()
        t1 = time.perf_counter()
        quantize_transform_pass.apply_inplace(graph, FIXED8)
        t2 = time.perf_counter()
        quantize_transform_pass(base, FIXED8)
        t3 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(seconds)
    params = sum(p.numel() for p in base.model.parameters())
    print(f"MiniLM graph: {params / 1e6:.1f}M parameters, {len(base.model.graph.nodes)} nodes, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats}:")
    for key, values in times.items():
        print(f"  {key}: {statistics.median(values) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
