"""Low-bit decode step: batch 1, one new token over a 128-token KV cache, of a 134M-parameter random Llama.

The memory-bound step of token generation (issue 28, item 3): every weight is read once per token, so the
floor is the bytes read per token over the machine's read bandwidth, printed first for fp32, bf16, int8
and int4 (measured bandwidth: the best of a few sums of a 1 GB fp32 tensor). Then, timed interleaved in one
run (benchmarks/timing.py: round robin, order rotating, medians), ms/token and the ratio to the fp32 eager
HF step (static cache) of:

* ``fp32-eager`` / ``bf16-eager`` -- the HF model itself;
* ``torchao-int8`` / ``torchao-int4`` -- torchao's ``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig``
  via ``quantize_`` on the eager model, where its CPU path runs (otherwise torchao's error is printed);
* ``aten-int8`` / ``aten-int4`` -- hand-made linears straight on ``aten._weight_int8pack_mm`` (per-channel)
  and ``aten._weight_int4pack_mm_for_cpu`` (group 128, bf16 activations): what the stock kernels give;
* ``fxforge-*`` -- the fxforge-captured decode-step graph, fp32 and lowered int8/int4 weight-only
  (decode_fxforge.py; a variant that cannot be built, e.g. a pass refusing, is listed with the error).

Targets (issue 28): lowered int4 <= 0.30x and int8 <= 0.50x of fp32 eager. Agreement: on ``--prompts``
random prompts, the fp32 eager model's prefill fills the cache (the same keys/values for every variant, so
this checks the timed step itself) and each variant's next token is compared with fp32's. Random weights
give near-tied logits, so the fp32 top-1 margin and each variant's logit error are reported beside the
counts (``ties``: prompts whose fp32 margin is below twice the variant's logit error; only there can the
top-1 differ).

    .venv/bin/python -m fxforge.benchmarks.bench_decode_lowbit [--rounds 20] [--prompts 100] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Protocol

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from fxforge.benchmarks.decode_fxforge import fxforge_decoders  # noqa: E402
from fxforge.benchmarks.decode_models import (  # noqa: E402
    LLAMA_134M,
    LLAMA_TINY,
    AtenInt4Linear,
    AtenInt8Linear,
    EagerDecode,
    build_llama,
    error_text,
    prefill_kv,
    swap_linears,
    torchao_model,
)
from fxforge.benchmarks.timing import interleaved  # noqa: E402

TARGETS = {"fxforge-int4": 0.30, "fxforge-int8": 0.50}
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


class Decoder(Protocol):
    """One variant's decode step: ``load`` a prompt's cache and input token, ``step`` gives fp32 logits."""

    def load(self, kv: Any, index: int, token: int) -> None: ...

    def step(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Format:
    """A weight format's bytes per token: linear weights at ``bits``, ``scale_bytes`` per ``per`` weights."""

    name: str
    bits: float
    scale_bytes: float = 0.0
    per: int = 1  # weights sharing one scale record; 0: one per output row
    act_bytes: int = 4  # the KV cache and the non-linear weights (norms, the embedding row)


FORMATS = {
    "fp32": Format("fp32", 32), "bf16": Format("bf16", 16, act_bytes=2),
    "int8": Format("int8 per-channel", 8, 4, 0), "int4": Format("int4 group 128", 4, 4, 128),
    "int4-32": Format("int4 group 32", 4, 4, 32),
}


def cpu_model() -> str:
    """The CPU's model name and the SIMD flags that matter for these kernels (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{name} ({os.cpu_count()} CPUs; {' '.join(f for f in CPU_FLAGS if f in flags) or 'no AVX2'})"


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of ``repeats`` sums of an fp32 tensor of ``nbytes``."""
    x = torch.ones(nbytes // 4)
    x.sum()  # touch the pages
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bytes_per_token(model: nn.Module, fmt: Format, cache_len: int) -> float:
    """Bytes a decode step reads: every linear weight (LM head included) in ``fmt``, its scales, the other
    weights but the embedding (one row read), and the KV cache (keys and values of ``cache_len + 1`` slots)."""
    linear = rows = other = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            linear += mod.weight.numel()
            rows += mod.out_features
        elif isinstance(mod, nn.Embedding):
            other += mod.embedding_dim
        elif not list(mod.children()):
            other += sum(p.numel() for p in mod.parameters(recurse=False))
    cfg: Any = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim * (cache_len + 1)
    scales = fmt.scale_bytes * (rows if fmt.per == 0 else linear / fmt.per)
    return float(linear * fmt.bits / 8 + scales + (other + kv) * fmt.act_bytes)


def eager_variants(model: nn.Module, cache_len: int, torchao: bool) -> tuple[dict[str, Decoder], dict[str, str]]:
    """The eager variants that built, and the error text of those that did not (torchao's CPU gaps)."""
    variants: dict[str, Decoder] = {
        "fp32-eager": EagerDecode(model, cache_len),
        "bf16-eager": EagerDecode(copy.deepcopy(model).to(torch.bfloat16), cache_len, torch.bfloat16),
        "aten-int8": EagerDecode(swap_linears(model, AtenInt8Linear), cache_len),
        "aten-int4": EagerDecode(swap_linears(model, AtenInt4Linear), cache_len),
    }
    errors: dict[str, str] = {}
    if not torchao:
        return variants, errors
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    try:
        variants["torchao-int8"] = EagerDecode(torchao_model(model, Int8WeightOnlyConfig(), torch.float32), cache_len)
    except Exception as e:  # noqa: BLE001 -- the benchmark reports what torchao raises and goes on
        errors["torchao-int8"] = error_text(e)
    int4_errors = []
    for fmt in ("plain", "plain_int32", "tile_packed_to_4d", "preshuffled"):  # torchao 0.18's packings
        config = Int4WeightOnlyConfig(int4_packing_format=fmt)
        try:  # a one-layer probe first: copying the whole model for a format that fails is wasted time
            torchao_model(nn.Linear(256, 256), config, torch.bfloat16)(torch.randn(1, 256, dtype=torch.bfloat16))
            variants["torchao-int4"] = EagerDecode(torchao_model(model, config, torch.bfloat16), cache_len,
                                                   torch.bfloat16)
            break
        except Exception as e:  # noqa: BLE001
            int4_errors.append(f"{fmt}: {error_text(e)}")
    else:
        errors["torchao-int4"] = "; ".join(int4_errors)
    return variants, errors


def agreement(variants: dict[str, Decoder], model: nn.Module, prompts: torch.Tensor) -> dict[str, Any]:
    """Per variant: prompts whose next token equals fp32 eager's, the fp32 top-1 margins where it differs,
    and the largest logit error per prompt (median, max); plus the fp32 margin statistics."""
    cache_len = prompts.shape[1] - 1
    ref_name = "fp32-eager"
    margins: list[float] = []
    spreads: list[float] = []  # the fp32 logits' standard deviation over the vocabulary: the scale of a margin
    same = {name: 0 for name in variants}
    missed: dict[str, list[float]] = {name: [] for name in variants}
    errs: dict[str, list[float]] = {name: [] for name in variants}
    ties = {name: 0 for name in variants}  # prompts whose fp32 margin is below twice the variant's logit error
    for part in prompts.split(8):
        kv = prefill_kv(model, part[:, :cache_len])
        for i in range(part.shape[0]):
            logits = {}
            for name, dec in variants.items():
                dec.load(kv, i, int(part[i, -1]))
                logits[name] = dec.step()
            top2 = logits[ref_name].topk(2).values
            margin = float(top2[0] - top2[1])
            margins.append(margin)
            spreads.append(float(logits[ref_name].std()))
            best = int(logits[ref_name].argmax())
            for name, lg in logits.items():
                err = float((lg - logits[ref_name]).abs().max())
                errs[name].append(err)
                ties[name] += margin < 2 * err
                if int(lg.argmax()) == best:
                    same[name] += 1
                else:
                    missed[name].append(margin)
    ordered = sorted(margins)
    return {
        "prompts": len(margins),
        "fp32_margin": {"min": ordered[0], "p10": ordered[len(ordered) // 10], "median": statistics.median(ordered),
                        "max": ordered[-1]},
        "fp32_logit_std_median": statistics.median(spreads),
        "same_top1": same,
        "fp32_margin_where_different": {n: sorted(m) for n, m in missed.items()},
        "max_abs_logit_err": {n: {"median": statistics.median(e), "max": max(e)} for n, e in errs.items()},
        "near_ties": ties,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=20, help="timed rounds (every variant once per round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=100, help="random prompts for the top-1 agreement")
    p.add_argument("--cache-len", type=int, default=128)
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the summed tensor")
    p.add_argument("--int4-block", type=int, default=128, choices=(32, 128),
                   help="fxforge-int4's MXINT4 block (one power-of-two scale per block of inputs)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-torchao", dest="torchao", action="store_false")
    p.add_argument("--quick", action="store_true",
                   help="a tiny Llama (hidden 128, 2 layers), cache 16, 8 prompts, 3 rounds: checks the script runs")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.prompts, args.cache_len, args.bandwidth_mb = 3, 1, 8, 16, 64
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = LLAMA_TINY if args.quick else LLAMA_134M
    model = build_llama(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    bandwidth = read_bandwidth(args.bandwidth_mb << 20)
    print(f"CPU {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"Llama {config} = {params / 1e6:.1f}M parameters (seed 0); batch 1, one new token, "
          f"{args.cache_len}-token KV cache", flush=True)
    print(f"read bandwidth (best of 5 sums of {args.bandwidth_mb} MB fp32): {bandwidth / 1e9:.2f} GB/s", flush=True)
    floor = {k: bytes_per_token(model, f, args.cache_len) / bandwidth for k, f in FORMATS.items()}
    for k, f in FORMATS.items():
        print(f"  ceiling {f.name:17s} {bytes_per_token(model, f, args.cache_len) / 1e6:8.1f} MB/token -> "
              f"{floor[k] * 1e3:7.2f} ms/token ({floor[k] / floor['fp32']:.2f}x of the fp32 floor)", flush=True)

    start = time.perf_counter()
    variants, errors = eager_variants(model, args.cache_len, args.torchao)
    fmt_of = {"fp32-eager": "fp32", "bf16-eager": "bf16", "aten-int8": "int8", "aten-int4": "int4",
              "torchao-int8": "int8", "torchao-int4": "int4"}
    fx, fx_errors, fx_formats = fxforge_decoders(model, args.cache_len, args.int4_block)
    variants.update(fx)
    errors.update(fx_errors)
    fmt_of.update(fx_formats)
    print(f"built {len(variants)} variants in {time.perf_counter() - start:.0f} s", flush=True)
    for name, text in errors.items():
        print(f"  {name}: {text}", flush=True)

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config["vocab_size"], (args.prompts, args.cache_len + 1), generator=gen)
    start = time.perf_counter()
    agree = agreement(variants, model, prompts)
    print(f"top-1 agreement on {args.prompts} prompts (fp32 prefill of each, then every variant's step): "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    kv = prefill_kv(model, prompts[:1, :args.cache_len])
    for dec in variants.values():  # time on the first prompt's cache
        dec.load(kv, 0, int(prompts[0, -1]))
    timings = interleaved({name: dec.step for name, dec in variants.items()}, args.rounds, warmup=args.warmup)
    med = timings.medians()
    base = med["fp32-eager"]
    print(f"\n{'variant':14s} {'ms/token':>9s} {'/fp32':>6s} {'pair':>6s} {'floor':>6s} {'target':>7s} "
          f"{'same top-1':>10s} {'ties':>5s} {'|dlogit| med/max':>17s}  fp32 margins where different")
    rows = {}
    for name in variants:
        target = TARGETS.get(name)
        ratio = med[name] / base
        rows[name] = {"ms": med[name] * 1e3, "ratio": ratio, "pair_ratio": timings.pair_ratio(name, "fp32-eager"),
                      "floor_ratio": floor[fmt_of[name]] / base, "target": target,
                      "meets_target": None if target is None else ratio <= target}
        err = agree["max_abs_logit_err"][name]
        diff = agree["fp32_margin_where_different"][name]
        mark = "" if target is None else f"<={target:.2f}{'+' if ratio <= target else '!'}"
        print(f"{name:14s} {med[name] * 1e3:9.2f} {ratio:6.2f} {rows[name]['pair_ratio']:6.2f} "
              f"{rows[name]['floor_ratio']:6.2f} {mark:>7s} {agree['same_top1'][name]:4d}/{agree['prompts']:<5d} "
              f"{agree['near_ties'][name]:5d} "
              f"{err['median']:8.4f}/{err['max']:.4f}  {', '.join(f'{m:.4f}' for m in diff[:6])}")
    m = agree["fp32_margin"]
    print(f"fp32 top-1 margin over {agree['prompts']} prompts: min {m['min']:.4f}, p10 {m['p10']:.4f}, median "
          f"{m['median']:.4f}, max {m['max']:.4f}; the fp32 logits' std over the vocabulary "
          f"{agree['fp32_logit_std_median']:.4f} (median): random weights give near-tied logits.\nties: prompts "
          f"whose fp32 margin is below twice the variant's logit error (a different top-1 is possible only "
          f"there)\n"
          f"floor: the format's bytes per token / bandwidth, over the fp32 eager median; pair: median of per-round "
          f"ratios; target: + met, ! missed")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    result = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "config": config, "params": params, "cache_len": args.cache_len, "rounds": args.rounds,
              "bandwidth_gbs": bandwidth / 1e9, "floor_ms": {k: v * 1e3 for k, v in floor.items()},
              "variants": rows, "errors": errors, "agreement": agree, "loadavg": os.getloadavg()}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
