"""Int8 lowering speed: MiniLM-L6 classifier forward at batch 8, length 128, fp32 vs int8 linears.

Every variant is the same export-captured ForgeGraph; the int8 ones are quantized with scaled int8
(per-channel symmetric weights; inputs calibrated on two batches ("static") or per batch ("dynamic"))
and lowered with lower_int8_transform_pass to onednn::qlinear_pointwise or fbgemm's
quantized::linear_dynamic.
Variants run interleaved (round robin) so that load from other processes hits them alike; the
ratio of median forward times is reported, plus the largest logit difference to fp32.

    .venv/bin/python -m fxforge.benchmarks.bench_quant_int8 [--rounds 15] [--variants onednn-static ...] [--torchao]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402
from fxforge.passes.quantize import (  # noqa: E402
    calibrate_transform_pass,
    lower_int8_transform_pass,
    quantize_transform_pass,
)


def int8_config(static: bool) -> dict:
    """Scaled int8 on every linear: per-channel symmetric weights; inputs calibrated (static) or dynamic."""
    data_in = {"data_in_width": 8, "data_in_symmetric": False, "data_in_dynamic": not static}
    return {"by": "type", "default": {"config": {"name": None}},
            "linear": {"config": {"name": "scaled_integer", **data_in, "weight_width": 8,
                                  "weight_granularity": "per_channel"}}}


def int8_graph(model: torch.nn.Module, backend: str, static: bool, calib: list[dict[str, torch.Tensor]]) -> ForgeGraph:
    """MiniLM captured, every linear quantized to scaled int8 (calibrated if static) and lowered."""
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = quantize_transform_pass(mg, int8_config(static))
    if static:
        mg, _ = calibrate_transform_pass(mg, {"data": calib})
    mg, _ = lower_int8_transform_pass(mg, {"backend": backend, "strict": True})
    return mg


def time_variants(variants: dict[str, Any], inputs: dict[str, torch.Tensor], rounds: int) -> dict[str, list[float]]:
    with torch.inference_mode():  # the warm-up rounds pack kernels and settle the allocator
        return interleaved({k: functools.partial(fn, **inputs) for k, fn in variants.items()}, rounds).times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["onednn-static", "onednn-dynamic", "fbgemm-dynamic"],
                        help="int8 variants: <onednn|fbgemm>-<static|dynamic> (fbgemm is dynamic only)")
    parser.add_argument("--torchao", action="store_true",
                        help="also time torchao's Int8DynamicActivationInt8WeightConfig on the eager HF model")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from fxforge.models.bert import minilm_for_sequence_classification

    torch.manual_seed(0)
    model = minilm_for_sequence_classification().eval()
    gen = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1000, 20000, (args.batch, args.length), generator=gen),
              "attention_mask": torch.ones(args.batch, args.length, dtype=torch.long)}
    fp32 = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    variants: dict[str, Any] = {"fp32": fp32}
    calib = [{"input_ids": torch.randint(1000, 20000, (args.batch, args.length), generator=gen),
              "attention_mask": torch.ones(args.batch, args.length, dtype=torch.long)} for _ in range(2)]
    for variant in args.variants:
        backend, mode = variant.split("-")
        variants[f"int8-{variant}"] = int8_graph(model, backend, mode == "static", calib)
    if args.torchao:  # eager HF model with torchao tensor subclasses (no torch.compile)
        import copy

        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        variants["fp32-eager"] = model
        ao_model = copy.deepcopy(model)
        quantize_(ao_model, Int8DynamicActivationInt8WeightConfig())
        variants["torchao-eager"] = ao_model
    with torch.inference_mode():
        ref = fp32(**inputs).logits
        agreement = {k: float((v(**inputs).logits - ref).abs().max()) for k, v in variants.items()}
    times = time_variants(variants, inputs, args.rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "batch": args.batch, "length": args.length,
        "rounds": args.rounds, "median_ms": med, "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "speedup_vs_fp32": {k: med["fp32"] / v for k, v in med.items()}, "max_abs_logit_diff": agreement,
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
