"""Pipeline and tensor-parallel inference on N = 1, 2, 4 processes with the same total threads: throughput and
per-rank memory (issue 32).

    .venv/bin/python -m fxforge.benchmarks.bench_distributed            # MiniLM classifier 32x128, GPT 16x1024
    .venv/bin/python -m fxforge.benchmarks.bench_distributed --quick    # tiny models, one round (the unit test)
    .venv/bin/python -m fxforge.benchmarks.bench_distributed --gpt toy  # the zoo's 2-layer GPT at 32x64 instead

The GPT is models/gpt.py's default (4 layers x 128 wide, vocab 256) at T = 1024, 16 rows: the zoo GPT the memory
benchmark trains at T = 1024, a forward of ~0.3 s here. ``--gpt toy`` runs ``fxforge.models.zoo.build("gpt")``
(2 layers x 64 wide) at 32 x 64 instead: a whole forward of ~7 ms, below what a message between processes costs
per microbatch, so it measures the launch's fixed overheads rather than a pipeline (and 2 layers give no 4 stages).

N = 1 is the unsplit graph in one process with every thread (the baseline); N > 1 splits the checkpoint's graph into
N time-balanced stages, one rank each (as ``fxforge pipeline-run`` does), and runs GPipe and 1F1B over microbatches,
and splits it with ``tensor_parallel`` ("tp": heads, FFN units, large embeddings and a vocabulary head sharded,
the whole batch on every rank); each rank gets total threads / N (at least one: N beyond the cores oversubscribes
them, and the report says so).
Every launch runs all models and schedules in interleaved repeats (benchmarks/distributed_ranks.py); launches run
in rounds (N = 1, 2, 4, then again), each number the median over rounds of a launch's median step time. Reported per
N: step time, samples/s and throughput relative to N = 1; the largest rank's parameter bytes relative to N = 1's;
each rank's peak memory while loading and while stepping. On a GPU machine the same script uses NCCL and one GPU per
rank (device from torch.cuda.is_available(); N above the GPU count is skipped, saying so).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge.benchmarks.distributed_ranks import BenchModel, RankMeasure, RankSpec, held_key, rank_entry  # noqa: E402

__all__ = ["PARAMS_TARGET", "SCHEDULES", "THROUGHPUT_TARGET", "both_met", "main", "summarize"]

THROUGHPUT_TARGET = 0.85  # at N = 2: throughput / one process with every thread, at least
PARAMS_TARGET = 0.55  # at N = 2: the largest rank's parameter bytes / the whole model's, at most
MIB = 2**20
SCHEDULES = ("gpipe", "1f1b", "tp")


def machine_line(total_threads: int) -> str:
    """The device, CPU model and load average, printed before any number (a loaded machine slows every row)."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    gpu = f"; GPU: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)" if torch.cuda.is_available() \
        else "; no GPU (gloo)"
    return f"CPU: {cpu}, {os.cpu_count()} cores, {total_threads} threads in total; load average {load}{gpu}"


def _models(quick: bool, workdir: Path, rows: int | None = None, gpt_size: str = "t1024") -> tuple[BenchModel, ...]:
    """The MiniLM classifier and the GPT (``gpt_size``: module docstring; tiny BERT and GPT with --quick), captured
    and checkpointed; ``rows`` overrides the batch size."""
    from fxforge import ForgeGraph
    from fxforge.models.bert import minilm_for_sequence_classification, tiny_bert
    from fxforge.models.gpt import GPT, GPTConfig
    from fxforge.models.zoo import build

    gen = torch.Generator().manual_seed(0)
    if quick:
        bert: torch.nn.Module = tiny_bert(vocab_size=100, num_attention_heads=4, max_position_embeddings=64).eval()
        torch.manual_seed(0)
        gpt: torch.nn.Module = GPT(GPTConfig(vocab_size=64, sequence_length=32, n_layer=2, n_head=4, n_embd=32)).eval()
        names, vocab, (batch, seq), gseq = ("tiny BERT", "tiny GPT"), (100, 64), (8, 16), 16
        gbatch = batch
    else:
        bert = minilm_for_sequence_classification(num_labels=2, seed=0).eval()
        vocab, (batch, seq) = (30522, 256), (32, 128)
        if gpt_size == "toy":
            gpt, gpt_name, gseq, gbatch = build("gpt").model, "zoo GPT 2x64", 64, 32
        else:
            torch.manual_seed(0)
            gpt = GPT(GPTConfig(vocab_size=256, sequence_length=1024)).eval()
            gpt_name, gseq, gbatch = "GPT 4x128 T=1024", 1024, 16
        names = ("MiniLM classifier", gpt_name)
    batch, gbatch = rows or batch, rows or gbatch
    bert_in = {"input_ids": torch.randint(0, vocab[0], (batch, seq), generator=gen),
               "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
    gpt_in = {"idx": torch.randint(0, vocab[1], (gbatch, gseq), generator=gen)}
    bert_graph = ForgeGraph(bert, hf_input_names=["input_ids", "attention_mask"]).eval()
    gpt_graph = ForgeGraph(gpt, gpt_in["idx"][:2]).eval()
    return (BenchModel(names[0], str(bert_graph.export(workdir / "bert")), bert_in),
            BenchModel(names[1], str(gpt_graph.export(workdir / "gpt")), gpt_in))


def summarize(runs: dict[int, list[list[dict[str, Any]]]], models: list[str], schedules: list[str],
              batch: dict[str, int]) -> list[dict[str, Any]]:
    """The table's rows from the launches' raw measures (``runs[N]``: per round, each rank's RankMeasure as a
    dict): step time = median over rounds of rank 0's median; the rest as the module docstring says."""
    def med_ms(n: int, variant: str) -> float:
        return 1e3 * statistics.median(statistics.median(ranks[0]["times"][variant]) for ranks in runs[n])

    rows: list[dict[str, Any]] = []
    for model in models:
        base_ms = med_ms(1, f"{model}/forward")
        base_held = max(r["held"][model] for r in runs[1][0])
        for n in sorted(runs):
            for schedule in ([v for v in ("forward", "microbatched") if f"{model}/{v}" in runs[1][0][0]["times"]]
                             if n == 1 else schedules):
                variant, key = f"{model}/{schedule}", held_key(model, schedule)
                last = runs[n][-1]  # memory: the last round's launch (every round loads alike)
                ms = med_ms(n, variant)
                held = [r["held"][key] for r in last]
                rows.append({"model": model, "schedule": schedule, "n": n, "threads": last[0]["threads"], "ms": ms,
                             "samples_per_s": batch[model] / (ms / 1e3), "rel_throughput": base_ms / ms,
                             "held": held, "held_ratio": max(held) / base_held,
                             "load_peak": [r["load_peak"][key] for r in last],
                             "run_peak": [r["run_peak"][variant] for r in last],
                             "cuts": last[0]["cuts"].get(model, [])})
    return rows


def checks(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The targets at N = 2, one fact per model and schedule (throughput) and per model and split (parameters: the
    pipeline's stages, shared by its schedules, or tensor parallelism's shards)."""
    out: dict[str, bool] = {}
    for row in rows:
        if row["n"] != 2:
            continue
        key = f"{row['model']} {row['schedule']} N=2: throughput {row['rel_throughput']:.2f}x of N=1 (target >= " \
              f"{THROUGHPUT_TARGET}x)"
        out[key] = row["rel_throughput"] >= THROUGHPUT_TARGET
        split = "tensor parallel" if row["schedule"] == "tp" else "pipeline"
        key = f"{row['model']} {split} N=2: largest rank's parameters {row['held_ratio']:.3f}x of N=1 (target <= " \
              f"{PARAMS_TARGET}x)"
        out[key] = row["held_ratio"] <= PARAMS_TARGET
    return out


def both_met(rows: list[dict[str, Any]]) -> list[str]:
    """The N = 2 configurations (model and schedule) meeting the throughput and the parameter target together."""
    return [f"{r['model']} {r['schedule']}" for r in rows if r["n"] == 2 and r["rel_throughput"] >= THROUGHPUT_TARGET
            and r["held_ratio"] <= PARAMS_TARGET]


def microbatched_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each pipeline row's throughput against one process running the same microbatches in turn (2 threads): at a
    large batch the whole-batch baseline slows per sample, and the ratio to it then flatters the pipeline."""
    alone = {r["model"]: r["ms"] for r in rows if r["n"] == 1 and r["schedule"] == "microbatched"}
    return [f"  {r['model']} {r['schedule']} N={r['n']}: {alone[r['model']] / r['ms']:.2f}x the throughput of one "
            "process over the same microbatches in turn" for r in rows
            if r["n"] > 1 and r["schedule"] != "tp" and r["model"] in alone]


def format_row(row: dict[str, Any]) -> str:
    """One table line (the unit test re-derives it from the JSON)."""
    held = "/".join(f"{b / MIB:.2f}" for b in row["held"])
    load = "/".join(f"{b / MIB:.0f}" for b in row["load_peak"])
    run = "/".join(f"{b / MIB:.0f}" for b in row["run_peak"])
    return (f"  {row['model']:<18} {row['schedule']:<12} {row['n']:>2} {row['threads']:>4} {row['ms']:>9.2f} "
            f"{row['samples_per_s']:>9.1f} {row['rel_throughput']:>6.2f}x {row['held_ratio']:>6.3f}x  {held:<24} "
            f"{load:<20} {run}")


def main(argv: list[str] | None = None) -> int:
    from fxforge.distributed.ddp import DDPOptions, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one round (seconds per launch)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="total threads shared by the ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=None, help="launches per N (default 2, 1 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per variant and launch")
    parser.add_argument("--microbatches", type=int, default=None, help="default 8 (4 with --quick)")
    parser.add_argument("--balance", choices=("time", "memory", "params"), default="time",
                        help="what split_stages_transform_pass balances across the stages")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                        help="pipeline schedules and tensor parallelism (tp) to run at N > 1")
    parser.add_argument("--models", nargs="+", choices=("minilm", "gpt"), default=["minilm", "gpt"],
                        help="which models to run (the MiniLM classifier / tiny BERT, the zoo GPT / tiny GPT)")
    parser.add_argument("--split-embedding", action="store_true",
                        help="pipeline: split the first stage's embedding table by rows over the ranks "
                             "(distributed/vocab_stage.py)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step for both models (default: MiniLM 32, "
                        "the GPT 16 at T=1024 or 32 with --gpt toy; 8 with --quick)")
    parser.add_argument("--gpt", choices=("t1024", "toy"), default="t1024", help="the GPT: models/gpt.py's default "
                        "4x128 at T=1024, or the zoo's 2-layer toy at T=64 (module docstring)")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--json", type=Path, help="also write the raw measures and rows here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 2)
    repeats = args.repeats or (3 if args.quick else 7)
    micro = args.microbatches or (4 if args.quick else 8)
    ranks = sorted(set(args.ranks) | {1})
    print(machine_line(args.threads), flush=True)
    notes = []
    if torch.cuda.is_available():
        ranks, skipped = [n for n in ranks if n <= torch.cuda.device_count()], [n for n in ranks
                                                                               if n > torch.cuda.device_count()]
        if skipped:
            notes.append(f"N={skipped} skipped: more ranks than the {torch.cuda.device_count()} GPU(s)")
    for n in ranks:
        if n > args.threads:
            notes.append(f"N={n}: {n} ranks x 1 thread on {args.threads} threads' worth of cores: oversubscribed")
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        built = dict(zip(("minilm", "gpt"), _models(args.quick, Path(tmp), args.batch, args.gpt), strict=True))
        models = tuple(built[name] for name in ("minilm", "gpt") if name in args.models)
        runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in ranks}
        for _ in range(rounds):
            for n in ranks:
                spec = RankSpec(models=models, schedules=tuple(args.schedules), microbatches=max(micro, n),
                                repeats=repeats, warmup=1, threads=max(1, args.threads // n), timeout=args.timeout,
                                balance=args.balance, split_embedding=args.split_embedding)
                result = launch(rank_entry, (spec,), DDPOptions(nproc=n, timeout=args.timeout, threads=spec.threads,
                                                                max_restarts=0))
                measures: list[RankMeasure] = [result[r] for r in sorted(result)]
                runs[n].append([asdict(m) for m in measures])
        batch = {m.name: next(iter(m.inputs.values())).shape[0] for m in models}
    rows = summarize(runs, [m.name for m in models], list(args.schedules), batch)
    facts = checks(rows)
    kind = runs[1][0][0]["peak_kind"]
    per_n = ", ".join(f"N={n}: {max(micro, n)}" for n in ranks if n > 1)
    table = " (the first stage's table split by rows)" if args.split_embedding else ""
    print(f"batch {batch}; microbatches {per_n}; {rounds} round(s) x {repeats} timed steps per launch; stages "
          f"balanced by {args.balance}{table}; a step is all ranks between two barriers; N=1 is the unsplit graph in "
          "one process")
    for note in notes:
        print(f"note: {note}")
    print(f"  {'model':<18} {'schedule':<12} {'N':>2} {'thr':>4} {'ms/step':>9} {'samples/s':>9} {'thrpt':>7} "
          f"{'params':>7}  {'params MiB per rank':<24} {kind + ' load MiB':<20} {kind} step MiB")
    for row in rows:
        print(format_row(row))
    for row in rows:
        if row["cuts"] and row["schedule"] == "gpipe":
            print(f"  cuts {row['model']} N={row['n']}: {', '.join(row['cuts'])}")
    for line in microbatched_lines(rows):
        print(line)
    for text, ok in facts.items():
        print(f"{'met    ' if ok else 'NOT met'} {text}")
    if 2 in ranks:
        print(f"both targets at N=2: {', '.join(both_met(rows)) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(args.threads), "quick": args.quick,
                                         "batch": batch, "rows": rows, "checks": facts,
                                         "runs": {str(n): v for n, v in runs.items()}}, indent=1))
    return 0 if all(facts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
