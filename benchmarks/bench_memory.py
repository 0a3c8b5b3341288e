"""Training-step activation memory and time: fxforge's activation checkpointing against the unmodified graph,
torch.utils.checkpoint on every layer, torch.compile's activation memory budget, and PEFT's LoRA (issue 31).

    .venv/bin/python -m fxforge.benchmarks.bench_memory                 # MiniLM 8x128, GPT T=1024, compile
    .venv/bin/python -m fxforge.benchmarks.bench_memory --no-compile    # without the ~30 s compiles
    .venv/bin/python -m fxforge.benchmarks.bench_memory --quick         # tiny models, seconds (the unit test)
    .venv/bin/python -m fxforge.benchmarks.bench_memory --only lora     # the LoRA rows alone (about a minute)

What is measured (benchmarks/memory_variants.py): a step is forward + loss + backward in train mode (dropout
on); every trainable weight's ``.grad`` is allocated and zeroed first. *Peak* is the CPU allocator's highest
level during one step above its level at the step's start (torch.profiler's per-allocation memory events):
saved activations, temporaries, workspaces, activation gradients in flight, weight-gradient buffers before
they are added into ``.grad`` and recomputation count; parameters, their grads and the inputs do not. Step
times are medians of interleaved rounds (every variant once per round, order rotating), after warm-up.
The liveness analysis's estimates are printed beside the measured peaks it defines (eval mode, summed outputs:
passes/analysis/step_memory.py) for the graphs before and after the pass.

The main rows ask "half the unmodified graph's activation memory, as fast as possible": its peak is measured
first and fxforge's checkpoint is planned for ``budget_mb = 0.5 x (1 - MARGIN) x that measured peak`` (MB = 2^20,
the units of the pass's estimate; the margin for the estimate's error: the zoo GPT's estimate runs 5 % high
before the pass, so half of the estimate measured 0.513x; after it the plan's estimate runs 4-6 % high: MiniLM
8x128 135.5 MB planned for 130.3 measured, the GPT 70.2 for 66.2). ``--fraction`` plans at a fraction of the
pass's own estimate of the unmodified peak instead.

The equal-memory rows ask "at the memory another method reaches, who is faster": once torch.compile's (budget
set to fxforge's measured share) and every-layer torch.utils.checkpoint's peaks are measured, fxforge is planned
to run within that MEASURED peak and timed in the same interleaved rounds (memory_variants.plan_equal_memory):
- at every-layer checkpoint's memory, eager as torch.utils.checkpoint is: full recomputation, and regions keeping
  only their attentions' results (``selective="attention"``), each fitted with ``measure`` (the pass measures its
  candidate plans' peaks, one step each, for ``budget_mb = (1 - MEASURED_MARGIN) x that peak``; the 0.5 % margin
  is for the step's loss: the pass sums the graph's outputs, the bench takes the loss);
- at torch.compile's memory: full recomputation planned on the estimate for ``(1 - MARGIN) x that peak`` (an
  eager measurement does not bound the compiled graph's peak), timed eager and compiled ("..., compiled":
  functorch's budget 1.0, the regions are the recomputation; AOTAutograd recomputes each traced checkpoint and
  replays its dropout; fusion on both sides, since torch.compile fuses too); and selective regions (each keeps
  its linears' and fused attentions' results, what compile's min-cut keeps) at the smallest peak the pass
  reaches, compiled: there the ops they recompute fuse into backward, so more regions save memory at little cost.
Every timed row's peak must be within the other's (a check); its step time is printed ("info"); the check on
time is one per reference: fxforge's fastest plan within the other's peak runs at most its step time. Where no
plan fits, the row is left out and the smallest peak the pass reports is printed.

The LoRA row asks what a user asks: "fit in 0.7x of what PEFT needs, as fast as possible". PEFT's peak is
measured first, and fxforge LoRA + checkpoint is planned for ``budget_mb = 0.7 x (1 - LORA_MARGIN) x PEFT's
measured peak``. The pass compares budget_mb with its own estimate of the same quantity (bytes above the
step's start: saved activations + the largest segment + a gradient in flight, MB = 2^20), so the units agree;
the 5 % margin is for the estimate's error (MiniLM 8x128 with LoRA: estimate 287.3 MB for a measured 290.3
before the pass, 1 % low; after it 251.5 planned for 254.5 measured, 1 % low). ``--lora-fraction``
plans at a fraction of fxforge LoRA's own estimated peak instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.benchmarks.memory_variants import (  # noqa: E402
    GPTWithLoss,
    How,
    Variant,
    checkpoint_every_layer,
    checkpoint_pass,
    classifier,
    gpt,
    loss_step,
    plan_budget,
    plan_checkpoints,
    plan_equal_memory,
    zero_grads,
)
from fxforge.benchmarks.timing import interleaved  # noqa: E402
from fxforge.passes.analysis.step_memory import allocator_peak  # noqa: E402
from fxforge.passes.memory.checkpoint_region import Selective  # noqa: E402

TARGETS = {"memory": 0.5, "time": 1.3, "lora_memory": 0.7, "lora_time": 1.2, "estimate": 0.10}
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.1
LORA_TARGETS = ["query", "key", "value", "dense"]
MARGIN = 0.02  # below 0.5x the unmodified graph's measured peak, for the planner's estimate error (docstring)
LORA_MARGIN = 0.05  # below 0.7x PEFT's measured peak, for the planner's estimate error (module docstring)
SECTIONS = ("all", "classifier", "gpt", "lora")
MB = 2**20
AT_COMPILE, AT_PER_LAYER = "fxforge at torch.compile's memory", "fxforge at every-layer checkpoint's memory"
AT_COMPILE_COMPILED = AT_COMPILE + ", compiled"
AT_COMPILE_SELECTIVE = "fxforge selective at torch.compile's memory, compiled"
AT_PER_LAYER_ATTENTION = "fxforge attention kept at every-layer checkpoint's memory"
MEASURED_MARGIN = 0.005  # equal-memory plans are fitted on measured peaks: only the step's loss differs (docstring)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or 'unknown CPU')."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def report_plan(info: Any, label: str, digits: int) -> dict[str, Any]:
    """Print a checkpoint plan's budget, segments, planned peak and recompute; return them for the JSON."""
    print(f"  fxforge plan ({label}): budget {info.budget_bytes / MB:.1f} MB, {info.segments} segments, planned "
          f"peak {info.planned_peak_bytes / MB:.1f} of {info.baseline_peak_bytes / MB:.1f} MB, recompute "
          f"{info.recompute_fraction:.{digits}f} of a forward")
    return {"budget_bytes": info.budget_bytes, "planned_peak_bytes": info.planned_peak_bytes,
            "baseline_peak_bytes": info.baseline_peak_bytes, "segments": info.segments,
            "recompute_fraction": info.recompute_fraction}


def plan_lora_budget(graph: ForgeGraph, inputs: dict[str, torch.Tensor], peft_peak: int
                     ) -> tuple[ForgeGraph, Any, float]:
    """Plan the LoRA graph for ``budget_mb`` = 0.7 x (1 - LORA_MARGIN) x PEFT's measured peak (plan_budget)."""
    return plan_budget(graph, inputs, round(TARGETS["lora_memory"] * (1.0 - LORA_MARGIN), 3), peft_peak)


def capture(model: nn.Module, inputs: dict[str, torch.Tensor]) -> ForgeGraph:
    """The model captured as fxforge sees it (its own copy), in train mode."""
    if isinstance(model, GPTWithLoss):
        return ForgeGraph(model, (inputs["idx"], inputs["targets"]), frontend="fx").train()
    return ForgeGraph(model, hf_input_names=list(inputs)).train()


def measure_peak(v: Variant) -> int:
    """One warm-up step, then the allocator's peak over one step (module docstring)."""
    zero_grads(v.modules)
    v.step()
    zero_grads(v.modules)
    return allocator_peak(v.step)[0]


def compiled(model: nn.Module, inputs: dict[str, torch.Tensor], budget: float) -> Variant:
    """torch.compile of the eager model with functorch's activation_memory_budget (min-cut recomputation)."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget  # read when the first call compiles (in measure_peak)
    eager = copy.deepcopy(model).train()
    return Variant(f"torch.compile budget {budget:.2f}", loss_step(torch.compile(eager), inputs), [eager])


def compiled_plan(graph: ForgeGraph, inputs: dict[str, torch.Tensor], name: str) -> Variant:
    """fxforge's checkpointed graph under torch.compile with functorch's default budget (1.0): the regions are
    the recomputation (AOTAutograd recomputes each traced checkpoint and replays its dropout), inductor fuses."""
    import torch._functorch.config as functorch_config

    step = loss_step(torch.compile(graph.model), inputs)

    def run() -> None:
        with functorch_config.patch(activation_memory_budget=1.0):  # the compile rows set it globally
            step()

    return Variant(name, run, [graph.model])


def liveness_lines(graph: ForgeGraph, inputs: dict[str, torch.Tensor], model: str, label: str,
                   checks: dict[str, bool], out: dict[str, Any]) -> None:
    """The liveness analysis's inference and step estimates against the peaks it measures (item 4)."""
    g = graph.copy()
    passes.init_metadata_analysis_pass(g)
    _, info = passes.liveness_analysis_pass(g, {"measure": True, "data": inputs})
    rows = {"inference": (info.peak_inference_bytes, info.measured_inference_bytes),
            "step": (info.peak_step_bytes, info.measured_step_bytes)}
    out[label] = {k: {"estimate": e, "measured": m} for k, (e, m) in rows.items()}
    print(f"  liveness estimate/measured, {label}: " + ", ".join(
        f"{k} {e / MB:.2f}/{(m or 0) / MB:.2f} MB = {e / (m or 1):.3f}" for k, (e, m) in rows.items()))
    for k, (e, m) in rows.items():
        checks[f"{model}, {label}: liveness {k} estimate within 10% of measured"] = bool(m) and abs(e - m) <= TARGETS[
            "estimate"] * (m or 0)


def run_section(title: str, variants: list[Variant], ref: str, repeats: int, warmup: int,
                extra: Callable[[dict[str, int]], list[Variant]] | list[Callable[[dict[str, int]], list[Variant]]]
                | None = None) -> dict[str, Any]:
    """Peaks (one step each, after warm-up), then interleaved step times; prints the table vs ``ref``. ``extra``
    makes variants from the peaks measured so far (each in turn, its variants measured before the next is
    called). A variant whose step raises is reported and left out (its targets then count as missed)."""
    peaks: dict[str, int] = {}
    failed: dict[str, str] = {}

    def measured(v: Variant) -> bool:
        try:
            peaks[v.name] = measure_peak(v)
        except Exception as exc:  # a benchmark reports a broken variant instead of stopping
            failed[v.name] = f"{type(exc).__name__}: {exc}"
            return False
        return True

    variants = [v for v in variants if measured(v)]
    for make in [] if extra is None else extra if isinstance(extra, list) else [extra]:
        variants += [v for v in make(peaks) if measured(v)]
    for v in variants:
        zero_grads(v.modules)
    timings = interleaved({v.name: v.step for v in variants}, repeats, warmup=warmup)
    med = timings.medians()
    width = max([40] + [len(v.name) + 1 for v in variants])
    print(f"\n{title}\n  {'variant':<{width}}{'peak MB':>10}{'x ' + ref[:12]:>16}{'step ms':>10}{'x time':>8}")
    for v in variants:
        print(f"  {v.name:<{width}}{peaks[v.name] / MB:>10.2f}{peaks[v.name] / peaks[ref]:>16.3f}"
              f"{med[v.name] * 1e3:>10.1f}{med[v.name] / med[ref]:>8.3f}")
    for name, why in failed.items():
        print(f"  {name:<{width}}FAILED {why[:200]}")
    return {"peak_bytes": peaks, "median_ms": {k: t * 1e3 for k, t in med.items()}, "failed": failed}


def bench_model(model: nn.Module, inputs: dict[str, torch.Tensor], label: str, args: argparse.Namespace,
                checks: dict[str, bool], results: dict[str, Any]) -> ForgeGraph:
    """Unmodified graph, fxforge's pass, checkpoint on every layer, torch.compile at fxforge's share, and fxforge
    planned again at each of the last two's measured peaks (time at equal memory)."""
    ckpt = checkpoint_pass()
    base = capture(model, inputs)
    variants = [Variant("unmodified graph", loss_step(base, inputs), [base.model])]
    per_layer = checkpoint_every_layer(model).train()
    variants.append(Variant("torch.utils.checkpoint every layer", loss_step(per_layer, inputs), [per_layer]))
    fx_name = "fxforge checkpoint"
    made: dict[str, ForgeGraph] = {}
    plan: dict[str, Any] = {}

    def fxforge_variant(peaks: dict[str, int]) -> list[Variant]:
        """Planned once the unmodified graph's peak is measured: budget_mb = 0.5 x (1 - MARGIN) x that peak
        (module docstring), or --fraction of the pass's own estimate."""
        nonlocal fx_name
        if ckpt is None or (args.fraction is None and "unmodified graph" not in peaks):
            return []
        if args.fraction is not None:
            ours, info, fraction = plan_checkpoints(base, inputs, args.fraction)
            fx_name = f"fxforge checkpoint fraction {fraction}"
        else:
            share = round(TARGETS["memory"] * (1.0 - MARGIN), 3)
            ours, info, share = plan_budget(base, inputs, share, peaks["unmodified graph"])
            fx_name = f"fxforge checkpoint {share}x unmodified"
        made["ours"] = ours
        plan.update(report_plan(info, label, 2))
        return [Variant(fx_name, loss_step(ours, inputs), [ours.model])]

    def compile_variant(peaks: dict[str, int]) -> list[Variant]:
        if args.no_compile:
            return []
        target = peaks.get(fx_name, peaks["unmodified graph"] * TARGETS["memory"]) / peaks["unmodified graph"]
        return [compiled(model, inputs, round(min(1.0, max(0.05, target)), 2))]

    equal: dict[str, dict[str, Any]] = {}

    def at_memory_of(prefix: str, rows: list[tuple[str, Selective, How, bool]]
                     ) -> Callable[[dict[str, int]], list[Variant]]:
        """fxforge planned for the measured peak of the variant named ``prefix...`` (once it is measured), one
        plan per (selective mode, how) in ``rows`` (row name, selective mode, how it is planned: see
        plan_equal_memory, timed compiled)."""

        def make(peaks: dict[str, int]) -> list[Variant]:
            ref = next((n for n in peaks if n.startswith(prefix)), None)
            if ckpt is None or ref is None:
                return []
            same: list[Variant] = []
            plans: dict[tuple[Selective, How], tuple[ForgeGraph | None, dict[str, Any]]] = {}
            for row, selective, how, compile_it in rows:
                if (selective, how) not in plans:
                    plans[selective, how] = plan_equal_memory(base, inputs, ref, peaks[ref],
                                                              MEASURED_MARGIN if how == "measured" else MARGIN,
                                                              selective=selective, how=how)
                ours, record = plans[selective, how]
                equal[row] = record
                if ours is None:
                    small = record["smallest_reachable_bytes"]
                    print(f"  {row} ({label}): no plan within {record['budget_bytes'] / MB:.1f} MB ({ref} measured "
                          f"{peaks[ref] / MB:.1f}); the smallest, as the pass reports it: "
                          f"{'unknown' if small is None else f'{small / MB:.1f} MB'}: not timed")
                    continue
                measured = record["measured_peak_bytes"]
                print(f"  {row} ({label}): {how} plan, budget {record['budget_bytes'] / MB:.1f} MB ({ref} measured "
                      f"{peaks[ref] / MB:.1f}), {record['segments']} segments, planned peak "
                      f"{record['planned_peak_bytes'] / MB:.1f} MB"
                      + ("" if measured is None else f", measured {measured / MB:.1f} ({record['measured_plans']} "
                         "plans measured)") + f", recompute {record['recompute_fraction']:.2f}")
                same.append(compiled_plan(ours, inputs, row) if compile_it
                            else Variant(row, loss_step(ours, inputs), [ours.model]))
            return same

        return make

    res = run_section(f"{label}: training step", variants, "unmodified graph", args.repeats, args.warmup,
                      [fxforge_variant, compile_variant,
                       at_memory_of("torch.compile", [(AT_COMPILE, False, "estimate", False),
                                                      (AT_COMPILE_COMPILED, False, "estimate", True),
                                                      (AT_COMPILE_SELECTIVE, True, "smallest", True)]),
                       at_memory_of("torch.utils.checkpoint", [(AT_PER_LAYER, False, "measured", False),
                                                               (AT_PER_LAYER_ATTENTION, "attention", "measured",
                                                                False)])])
    res["plan"] = plan
    res["equal_memory"] = equal
    results[label] = res
    peak, ms = res["peak_bytes"], res["median_ms"]
    if ckpt is not None:
        inf = float("inf")
        checks[f"{label}: fxforge peak <= {TARGETS['memory']}x unmodified"] = (
            peak.get(fx_name, inf) <= TARGETS["memory"] * peak["unmodified graph"])
        checks[f"{label}: fxforge step time <= {TARGETS['time']}x unmodified"] = (
            ms.get(fx_name, inf) <= TARGETS["time"] * ms["unmodified graph"])
        by_ref: dict[str, list[str]] = {}  # time at equal memory: fxforge planned for the other's measured peak
        for row, record in equal.items():
            by_ref.setdefault(record["reference"], []).append(row)
        for ref, rows in by_ref.items():
            timed = [r for r in rows if r in peak]
            for row in timed:
                checks[f"{label}: {row}: peak <= {ref}'s"] = peak[row] <= peak[ref]
                print(f"  info ({label}): {row}: {peak[row] / MB:.1f} MB, {ms[row] / ms[ref]:.3f}x {ref}'s step time")
            fits = [r for r in timed if peak[r] <= peak[ref]]
            best = min(fits, key=lambda n: ms[n], default=None)
            checks[f"{label}: fxforge's fastest plan within {ref}'s peak ({best}): step time <= {ref}'s"] = (
                best is not None and ms[best] <= ms[ref])
    res["liveness"] = {}
    liveness_lines(base, inputs, label, "unmodified graph", checks, res["liveness"])
    if "ours" in made and fx_name in peak:
        liveness_lines(made["ours"], inputs, label, "after the pass", checks, res["liveness"])
    return base


def bench_lora(model: nn.Module, inputs: dict[str, torch.Tensor], label: str, graph: ForgeGraph,
               args: argparse.Namespace, checks: dict[str, bool], results: dict[str, Any]) -> None:
    """PEFT's LoRA against fxforge's LoRA (on ``graph``, the classifier's capture), alone and with the pass."""
    from peft import LoraConfig, get_peft_model

    theirs = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=LORA_TARGETS,
        modules_to_save=["classifier"])).train()
    variants = [Variant("PEFT LoRA", loss_step(theirs, inputs), [theirs])]
    for p in graph.model.parameters():  # the full fine-tuning's grads are not the adapters' business
        p.grad = None
    ours, _ = passes.insert_lora_adapter_transform_pass(graph, {  # a transform: graph itself is left as it is
        "rank": LORA_RANK, "alpha": float(LORA_ALPHA), "dropout": LORA_DROPOUT,
        "targets": {"name": LORA_TARGETS}, "trainable": {"name": "classifier"}})
    ours.train()
    variants.append(Variant("fxforge LoRA", loss_step(ours, inputs), [ours.model]))
    ckpt = checkpoint_pass()
    name = "fxforge LoRA + checkpoint"
    planned: dict[str, Any] = {}

    def planned_variant(peaks: dict[str, int]) -> list[Variant]:
        """Planned once PEFT's peak is measured: at a share of it (module docstring), or --lora-fraction."""
        nonlocal name
        if ckpt is None or (args.lora_fraction is None and "PEFT LoRA" not in peaks):
            return []  # without PEFT's peak there is no budget (its failure is reported in the table)
        if args.lora_fraction is not None:
            both, info, fraction = plan_checkpoints(ours, inputs, args.lora_fraction)
            name = f"fxforge LoRA + checkpoint fraction {fraction}"
        else:
            both, info, share = plan_lora_budget(ours, inputs, peaks["PEFT LoRA"])
            name = f"fxforge LoRA + checkpoint {share}x PEFT"
        planned.update(report_plan(info, "LoRA", 3))
        return [Variant(name, loss_step(both, inputs), [both.model])]

    res = run_section(f"LoRA fine-tuning, {label} (rank {LORA_RANK}, {', '.join(LORA_TARGETS)} + head)",
                      variants, "PEFT LoRA", args.repeats, args.warmup, planned_variant)
    res["plan"] = planned
    results["lora"] = res
    if ckpt is not None:
        peak, ms, inf = res["peak_bytes"], res["median_ms"], float("inf")
        checks[f"LoRA: fxforge + checkpoint peak <= {TARGETS['lora_memory']}x PEFT's"] = (
            peak.get(name, inf) <= TARGETS["lora_memory"] * peak["PEFT LoRA"])
        checks[f"LoRA: fxforge + checkpoint step time <= {TARGETS['lora_time']}x PEFT's"] = (
            ms.get(name, inf) <= TARGETS["lora_time"] * ms["PEFT LoRA"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds, no compile (seconds)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    parser.add_argument("--fraction", type=float, help="plan fxforge's checkpoint at this fraction of the pass's "
                        "estimate of the unmodified peak instead of 0.5 x (1 - MARGIN) of its measured peak")
    parser.add_argument("--lora-fraction", type=float, help="plan fxforge LoRA + checkpoint at this fraction of "
                        "its own peak instead of 0.7 x (1 - LORA_MARGIN) of PEFT's measured peak")
    parser.add_argument("--only", choices=SECTIONS, default="all", help="run one section: the MiniLM classifier, "
                        "the GPT or the LoRA rows (default: all)")
    parser.add_argument("--repeats", type=int, default=0, help="timed rounds (default 10; quick 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.no_compile = args.no_compile or args.quick
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.warmup = 0 if args.quick else 2  # measuring a peak already ran every variant twice
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if checkpoint_pass() is None:
        print("fxforge pass: not available yet")
    checks: dict[str, bool] = {}
    results: dict[str, Any] = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "quick": args.quick}
    model, inputs, label = classifier(args.quick)
    if args.only in ("all", "classifier"):
        graph = bench_model(model, inputs, label, args, checks, results)
    else:
        graph = capture(model, inputs)
    if args.only in ("all", "gpt"):
        bench_model(*gpt(args.quick), args, checks, results)
    if args.only in ("all", "lora"):
        bench_lora(model, inputs, label, graph, args, checks, results)
    print()
    for name, ok in checks.items():
        print(f"{'met   ' if ok else 'MISSED'} {name}")
    results["checks"] = checks
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
