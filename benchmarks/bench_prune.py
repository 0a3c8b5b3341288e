"""Pruning speed: MiniLM-L6 classifier forward at batch 8, length 128, dense vs pruned.

Variants, timed interleaved (round robin) in one run, medians:
* ``dense`` -- the captured graph; ``dense-eager`` -- the HF model itself (Torch-Pruning's baseline);
* ``elementwise-50`` -- global L1 50 % masks (no sparse kernel: honestly no speed-up);
* ``shrunk`` -- 50 % FFN units + a third of the heads masked, then physically removed (fxforge);
* ``torch-pruning`` -- Torch-Pruning (DepGraph) at the same target on the eager HF model;
* ``shrunk-int8`` / ``dense-int8`` -- scaled int8 (calibrated inputs) lowered to onednn on both graphs,
  to show that pruning and int8 compose (their speed-ups multiply).

    .venv/bin/python -m fxforge.benchmarks.bench_prune [--rounds 15] [--no-int8] [--no-tp]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fxforge.benchmarks.bench_quant_int8 import int8_config, time_variants  # noqa: E402
from fxforge.benchmarks.prune_recipes import ELEMENTWISE, FFN, HEADS, torch_pruning_model  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402
from fxforge.passes.prune import prune_transform_pass, shrink_transform_pass  # noqa: E402
from fxforge.passes.quantize import (  # noqa: E402
    calibrate_transform_pass,
    lower_int8_transform_pass,
    quantize_transform_pass,
)


def lowered(mg: ForgeGraph, calib: list[dict[str, torch.Tensor]]) -> ForgeGraph:
    mg, _ = quantize_transform_pass(mg.copy(), int8_config(True))
    mg, _ = calibrate_transform_pass(mg, {"data": calib})
    mg, _ = lower_int8_transform_pass(mg, {"backend": "onednn", "strict": True})
    return mg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--no-int8", action="store_true")
    parser.add_argument("--no-tp", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from fxforge.models.bert import minilm_for_sequence_classification

    torch.manual_seed(0)
    model = minilm_for_sequence_classification().eval()
    gen = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1000, 20000, (args.batch, args.length), generator=gen),
                "attention_mask": torch.ones(args.batch, args.length, dtype=torch.long)}

    inputs, calib = batch(), [batch(), batch()]
    dense = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    elementwise, _ = prune_transform_pass(dense.copy(), ELEMENTWISE)
    masked, _ = prune_transform_pass(dense.copy(), FFN)
    masked, _ = prune_transform_pass(masked, HEADS)
    shrunk, sinfo = shrink_transform_pass(masked.copy())
    variants: dict[str, Any] = {"dense": dense, "elementwise-50": elementwise, "shrunk": shrunk}
    if not args.no_tp:
        variants["dense-eager"] = model
        variants["torch-pruning"] = torch_pruning_model(copy.deepcopy(model), {k: v[:2] for k, v in inputs.items()})
    if not args.no_int8:
        variants["dense-int8"] = lowered(dense, calib)
        variants["shrunk-int8"] = lowered(shrunk, calib)
    with torch.inference_mode():
        ref = masked(**inputs).logits
        shrink_err = float((shrunk(**inputs).logits - ref).abs().max())
    times = time_variants(variants, inputs, args.rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = {"shrunk vs dense": med["dense"] / med["shrunk"],
              "elementwise-50 vs dense": med["dense"] / med["elementwise-50"]}
    if "torch-pruning" in med:
        ratios["torch-pruning vs dense-eager"] = med["dense-eager"] / med["torch-pruning"]
    if "shrunk-int8" in med:
        ratios["shrunk-int8 vs dense"] = med["dense"] / med["shrunk-int8"]
        ratios["dense-int8 vs dense"] = med["dense"] / med["dense-int8"]
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "batch": args.batch,
              "length": args.length, "rounds": args.rounds, "median_ms": med, "speedup": ratios,
              "params": {"dense": sinfo.params_before, "shrunk": sinfo.params_after},
              "shrink_max_abs_logit_diff_vs_masked": shrink_err, "loadavg": os.getloadavg()}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
