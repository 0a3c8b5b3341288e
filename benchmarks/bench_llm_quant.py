"""Data-aware LLM weight quantization side by side (issue 35 item 4): round-to-nearest, GPTQ, rotation + GPTQ
and AWQ at 4 and 3 bits, on the zoo GPT (held-out perplexity) and MiniLM fine-tuned on IMDb (held-out accuracy).

    .venv/bin/python -m fxforge.benchmarks.bench_llm_quant --quick   # tiny models trained for seconds (< 1 min)
    .venv/bin/python -m fxforge.benchmarks.bench_llm_quant           # the real models (trains / fine-tunes once)

Weights only: the linears of every transformer block get quantized weights, activations stay fp32. A method
whose pass is missing, refuses the model or the format, or leaves the model as it was (rotation on a model it
does not support) is a row "not available: <the pass's message>", never dropped. Results are written as JSON
and a markdown table in the run directory; numbers do not depend on machine load (only the pass times do).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge.benchmarks.bench_woq_int8 import cpu_model  # noqa: E402
from fxforge.benchmarks.llm_quant_models import Subject, gpt_subject, minilm_subject  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402
from fxforge.passes import get_pass  # noqa: E402
from fxforge.passes.batching import evaluating, run_batch  # noqa: E402

FORMATS: dict[str, dict[str, Any]] = {  # weight formats, by the name printed in the table (bits added per run)
    "scaled_integer": {"name": "scaled_integer", "weight_granularity": "per_channel", "weight_symmetric": True},
    "integer": {"name": "integer", "weight_frac_width": "auto"},  # power-of-two scale per output row
    "mxint": {"name": "mxint", "weight_block_size": 32},  # shared exponent per block of 32
}
METHODS = ("RTN", "GPTQ", "rotation+GPTQ", "AWQ")
PASSES = {"RTN": "quantize_transform_pass", "GPTQ": "gptq_transform_pass", "AWQ": "awq_transform_pass",
          "rotation": "rotate_hadamard_transform_pass"}
ROTATION_TOL = 1e-4  # rotation alone must leave the fp32 outputs equal (the pass's contract: 1e-5, relative)


class NotAvailable(Exception):
    """A method that cannot produce this row; the message is printed as the row's reason."""


def weight_config(fmt: str, bits: int, targets: str) -> dict[str, Any]:
    """The quantize config: ``fmt`` at ``bits`` on the weights of the linears ``targets`` matches, nothing else."""
    return {"by": "regex", "default": {"config": {"name": None}},
            targets: {"config": {**FORMATS[fmt], "weight_width": bits}}}


def target_layers(graph: ForgeGraph, targets: str) -> list[str]:
    """Module paths of the linears the config names (what every method must quantize)."""
    return [p for p, m in graph.model.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(targets, p)]


def outputs(graph: ForgeGraph, batch: Any) -> torch.Tensor:
    """The logits of ``graph`` on one batch (GPT: a tensor; HF: a ModelOutput)."""
    from fxforge.search.task import logits_of

    with evaluating(graph.model):
        return logits_of(run_batch(graph, batch)).float()


def rotated(subject: Subject) -> tuple[ForgeGraph, dict[str, Any]]:
    """The fp32 graph after the rotation pass, checked to compute the same outputs (NotAvailable otherwise)."""
    try:
        graph, info = get_pass(PASSES["rotation"])(subject.graph, dict(subject.rotate_args))
    except Exception as exc:  # noqa: BLE001 - any refusal is the row's reason
        raise NotAvailable(f"{type(exc).__name__}: {exc}") from None
    reason = getattr(info, "unsupported", "")
    if reason or not info.changed:
        raise NotAvailable(f"{PASSES['rotation']} left the model unchanged: {reason or 'changed=False'}")
    ref = outputs(subject.graph, subject.calib[0])
    diff = (outputs(graph, subject.calib[0]) - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
    if diff > ROTATION_TOL:
        raise NotAvailable(f"{PASSES['rotation']} changed the fp32 outputs by {diff:.2e} (relative; > {ROTATION_TOL})")
    return graph, {"rotation_alone_rel_max_diff": diff, **{k: v for k, v in vars(info).items()
                                                           if isinstance(v, int | float | str) and k != "changed"}}


def quantize(subject: Subject, method: str, cfg: dict[str, Any], rotation: Any) -> tuple[ForgeGraph, dict[str, Any]]:
    """``subject``'s graph quantized by ``method`` (a new graph) and what the pass reported."""
    notes: dict[str, Any] = {}
    base = subject.graph
    if method == "rotation+GPTQ":
        if isinstance(rotation, NotAvailable):
            raise rotation
        base, notes = rotation[0], dict(rotation[1])
    name = PASSES["GPTQ" if method == "rotation+GPTQ" else method]
    args: dict[str, Any] = cfg if method == "RTN" else {"config": cfg, "data": subject.calib}
    try:
        graph, info = get_pass(name)(base, args)
    except Exception as exc:  # noqa: BLE001 - a missing pass (KeyError) or a refusal is the row's reason
        raise NotAvailable(f"{type(exc).__name__}: {exc}") from None
    wanted = target_layers(base, subject.targets)
    done = [p for p, m in graph.model.named_modules() if hasattr(m, "weight_quantizer")]
    if sorted(done) != sorted(wanted):
        raise NotAvailable(f"{name} quantized {len(done)} layers, not the {len(wanted)} block linears")
    skipped = sorted(set(getattr(info, "skipped", {}) or {}) & set(wanted))
    if skipped:
        notes["round_to_nearest_kept"] = {p: info.skipped[p] for p in skipped}
    return graph, notes


def measure(subject: Subject, formats: list[str], bits: list[int], methods: list[str]) -> dict[str, Any]:
    """fp32 and every (format, bits, method) on one model; unavailable rows carry the error message."""
    fp32 = subject.evaluate(subject.graph)
    paired_fp32 = None if subject.paired is None else subject.paired[2](subject.graph)
    print(f"\n{subject.name}: fp32 {subject.metric} {fp32:.4f}"
          + ("" if subject.paired is None else f", {subject.paired[0]} {paired_fp32:.4f}"), flush=True)
    rotation: Any = None
    if "rotation+GPTQ" in methods:
        try:
            rotation = rotated(subject)
            print(f"  rotation alone: relative max |Δ output| {rotation[1]['rotation_alone_rel_max_diff']:.2e}")
        except NotAvailable as exc:
            rotation = exc
    rows = []
    for fmt in formats:
        for b in bits:
            cfg = weight_config(fmt, b, subject.targets)
            for method in methods:
                row: dict[str, Any] = {"format": fmt, "bits": b, "method": method}
                t0 = time.perf_counter()
                try:
                    graph, row["notes"] = quantize(subject, method, cfg, rotation)
                    row["pass_seconds"] = time.perf_counter() - t0
                    row["value"] = subject.evaluate(graph)
                    row["delta"] = row["value"] - fp32
                    shown = f"{row['value']:.4f} ({row['delta']:+.4f})"
                    if subject.paired is not None and paired_fp32 is not None:
                        row["paired"] = subject.paired[2](graph)
                        row["paired_delta"] = row["paired"] - paired_fp32
                        shown += f", {subject.paired[0]} {row['paired']:.4f} ({row['paired_delta']:+.4f})"
                except NotAvailable as exc:
                    row["error"] = str(exc)
                    shown = f"not available: {exc}"
                rows.append(row)
                print(f"  {fmt:>14} {b}b {method:>14}: {shown[:200]}", flush=True)
    return {"name": subject.name, "metric": subject.metric, "higher_is_better": subject.higher_is_better,
            "fp32": fp32, "targets": subject.targets, "layers": len(target_layers(subject.graph, subject.targets)),
            "setup": subject.setup, "rotate_args": subject.rotate_args, "rows": rows,
            "paired": None if subject.paired is None else
            {"metric": subject.paired[0], "higher_is_better": subject.paired[1], "fp32": paired_fp32},
            "rotation": None if rotation is None else
            {"error": str(rotation)} if isinstance(rotation, NotAvailable) else rotation[1]}


def pass_defaults(method: str) -> dict[str, Any] | str:
    """The arguments ``method``'s pass runs with besides config and data (its defaults), or why it is missing."""
    from dataclasses import MISSING, fields

    try:
        spec = get_pass(PASSES[method]).spec
    except KeyError as exc:
        return f"not available: {_short(str(exc), 80)}"
    return {f.name: f.default if f.default is not MISSING else "(factory)" for f in fields(spec.args_type)
            if f.name not in ("config", "data")}


def _short(msg: str, limit: int = 240) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[:limit - 1] + "…"


def table(result: dict[str, Any], formats: list[str], bits: list[int], methods: list[str]) -> str:
    """Markdown: one row per method, one column per (format, bits); a method unavailable everywhere for one
    reason is one row "not available: <reason>", other gaps are footnoted."""
    cols = [(f, b) for f in formats for b in bits]
    better = "higher" if result["higher_is_better"] else "lower"
    head = [f"{result['name']}: {result['metric']} ({better} is better)", *(f"{f} {b}-bit" for f, b in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| fp32 | " + " | ".join(f"{result['fp32']:.4f}" for _ in cols) + " |"]
    notes: list[str] = []
    by_key = {(r["format"], r["bits"], r["method"]): r for r in result["rows"]}
    for method in methods:
        cells = [by_key.get((f, b, method)) for f, b in cols]
        errors = {c["error"] for c in cells if c is not None and "error" in c}
        if len(errors) == 1 and all(c is not None and "error" in c for c in cells):
            lines.append(f"| {method} | not available: {_short(errors.pop())} |" + " |" * (len(cols) - 1))
            continue
        shown = []
        for c in cells:
            if c is None:
                shown.append("-")
            elif "error" in c:
                notes.append(f"[{len(notes) + 1}] {method}, {c['format']} {c['bits']}-bit: not available: "
                             f"{_short(c['error'])}")
                shown.append(f"not available [{len(notes)}]")
            else:
                kept = c.get("notes", {}).get("round_to_nearest_kept", {})
                if kept:  # measured, but some layers were not rounded by the method: said, not hidden
                    notes.append(f"[{len(notes) + 1}] {method}, {c['format']} {c['bits']}-bit: {len(kept)} of "
                                 f"{result['layers']} layers kept round-to-nearest: "
                                 f"{_short(next(iter(kept.values())))}")
                shown.append(f"{c['value']:.4f} ({c['delta']:+.4f})" + (f" [{len(notes)}]" if kept else ""))
        lines.append(f"| {method} | " + " | ".join(shown) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def paired_view(result: dict[str, Any]) -> dict[str, Any] | None:
    """``result`` as measured by its paired metric (rows' ``value`` / ``delta`` swapped for it), for :func:`table`
    and :func:`verdict`; None when the model has no paired metric."""
    paired = result.get("paired")
    if not paired:
        return None
    rows = [{**r, "value": r["paired"], "delta": r["paired_delta"]} if "paired" in r else r for r in result["rows"]]
    return {**result, "metric": paired["metric"], "higher_is_better": paired["higher_is_better"],
            "fp32": paired["fp32"], "rows": rows}


def verdict(result: dict[str, Any], methods: list[str], baseline: str = "RTN") -> list[str]:
    """Per method: in how many measured (format, bits) cells it loses less than ``baseline`` (strictly better
    value), by the model's metric and by its paired metric when it has one."""
    views = [result] + [v for v in (paired_view(result),) if v is not None]
    lines = []
    for method in (m for m in methods if m != baseline):
        parts = []
        for view in views:
            by_key = {(r["format"], r["bits"], r["method"]): r for r in view["rows"] if "value" in r}
            sign = 1 if view["higher_is_better"] else -1
            cells = [(k[0], k[1]) for k in by_key if k[2] == method and (k[0], k[1], baseline) in by_key]
            wins = sum(sign * (by_key[(f, b, method)]["value"] - by_key[(f, b, baseline)]["value"]) > 0
                       for f, b in cells)
            parts.append(f"{wins}/{len(cells)} by {view['metric']}")
        lines.append(f"{result['name']}: {method} loses less than {baseline} in " + ", ".join(parts))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny GPT and tiny BERT trained for seconds (smoke run)")
    p.add_argument("--models", nargs="+", choices=("gpt", "minilm"), default=["gpt", "minilm"])
    p.add_argument("--formats", nargs="+", choices=tuple(FORMATS), default=None,
                   help="default: all (quick: scaled_integer and mxint)")
    p.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--run-dir", type=Path, default=Path("out/bench-llm-quant"),
                   help="trained models are cached here; results go to bench_llm_quant.{json,md}")
    p.add_argument("--calib-seqs", type=int, default=None, help="calibration sequences (default 128; quick 16)")
    p.add_argument("--eval-windows", type=int, default=None, help="GPT held-out windows (default 512; quick 16)")
    p.add_argument("--eval-reviews", type=int, default=None, help="held-out reviews (default 500; quick 32)")
    p.add_argument("--train-reviews", type=int, default=None, help="MiniLM fine-tune reviews (default 2000; "
                                                                     "quick 64)")
    p.add_argument("--gpt-steps", type=int, default=None, help="GPT training steps (default 600; quick 40)")
    p.add_argument("--gpt-tiny", action="store_true", help="the quick run's 2-layer, 64-wide GPT (trained --gpt-steps)")
    p.add_argument("--max-length", type=int, default=128, help="MiniLM tokens per review")
    p.add_argument("--finetune-epochs", type=float, default=1.0)
    p.add_argument("--finetune-lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print and write its tables; return the JSON it wrote."""
    args = build_parser().parse_args(argv)
    q = args.quick
    args.formats = args.formats or (["scaled_integer", "mxint"] if q else list(FORMATS))
    calib = args.calib_seqs or (16 if q else 128)
    sizes = {"calib_seqs": calib, "eval_windows": args.eval_windows or (16 if q else 512),
             "eval_reviews": args.eval_reviews or (32 if q else 500),
             "train_reviews": args.train_reviews or (64 if q else 2000), "gpt_steps": args.gpt_steps}
    torch.manual_seed(args.seed)
    run: Path = args.run_dir
    run.mkdir(parents=True, exist_ok=True)
    cpu = f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; load average " + \
          " ".join(f"{v:.2f}" for v in os.getloadavg())
    defaults = {m: pass_defaults(m) for m in ("GPTQ", "AWQ") if m in args.methods or m == "GPTQ"}
    command = [sys.executable, "-m", "fxforge.benchmarks.bench_llm_quant", *(sys.argv[1:] if argv is None else argv)]
    header = [cpu, f"command: {' '.join(command)}",
              "weights-only quantization: the weights of every transformer-block linear are quantized, activations "
              "stay fp32; embeddings, norms, LM head, pooler and classifier stay fp32",
              f"weight formats (weight_width = bits): {json.dumps(FORMATS)}",
              f"passes: {json.dumps(PASSES)}; GPTQ / AWQ args: config + data (the calibration batches), the rest "
              f"at their defaults: {json.dumps(defaults, default=str)}",
              f"sizes: {json.dumps(sizes)}, seed {args.seed}" + (" (--quick: tiny models, numbers mean nothing)" if q
                                                                  else "")]
    print("\n".join(header), flush=True)
    results = []
    for which in args.models:
        if which == "gpt":
            subject = gpt_subject(run, q, calib, sizes["eval_windows"], args.gpt_steps, args.seed, args.gpt_tiny)
        else:
            subject = minilm_subject(run, q, calib, sizes["eval_reviews"], sizes["train_reviews"], args.max_length,
                                     args.finetune_epochs, args.finetune_lr)
        print(f"{subject.name}: {json.dumps(subject.setup, default=str)}", flush=True)
        results.append(measure(subject, args.formats, args.bits, args.methods))
    tables = []
    for r in results:
        views = [r] + [v for v in (paired_view(r),) if v is not None]
        tables.append("\n\n".join([*(table(v, args.formats, args.bits, args.methods) for v in views),
                                    "\n".join(f"- {line}" for line in verdict(r, args.methods))]))
    setups = [f"- {r['name']}: {json.dumps(r['setup'], default=str)}; quantized: {r['layers']} linears matching "
              f"`{r['targets']}`; rotation {json.dumps(r['rotate_args'])}: {json.dumps(r['rotation'], default=str)}"
              for r in results]
    md = "\n".join(["# bench_llm_quant", "", *(f"- {h}" for h in header), *setups, "", "\n\n".join(tables), ""])
    print("\n" + "\n\n".join(tables), flush=True)
    out = {"cpu": cpu, "header": header, "quick": q, "weights_only": True, "formats": FORMATS, "passes": PASSES,
           "bits": args.bits, "methods": args.methods, "sizes": sizes, "seed": args.seed, "models": results}
    (run / "bench_llm_quant.json").write_text(json.dumps(out, indent=1, default=str))
    (run / "bench_llm_quant.md").write_text(md)
    print(f"\nwrote {run / 'bench_llm_quant.json'} and {run / 'bench_llm_quant.md'}")
    return out


if __name__ == "__main__":
    main()
