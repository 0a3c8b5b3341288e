"""A joint compression search on the fine-tuned MiniLM over IMDb: bits × structured sparsity × recovery.

    .venv/bin/python -m fxforge.examples.search_joint --trials 24                     # LoRA recipe
    .venv/bin/python -m fxforge.examples.search_joint --recipe distill --trials 12
    .venv/bin/python -m fxforge.examples.search_joint --recipe qat --trials 12
    .venv/bin/python -m fxforge.examples.search_joint --time-to-target --recipe qat --workers 2 --seed 1 \
        --prior sensitivity --pruner hyperband --timeout 1800 --run-dir out/ttt-seed1 --base-dir out/minilm-imdb


Each trial copies the fine-tuned base graph, prunes FFN units and attention heads (and physically
removes them: the model gets smaller and faster) and recovers: ``lora`` inserts LoRA adapters of the
sampled rank, fine-tunes them briefly and fuses them; ``distill`` prunes by the taylor criterion and
fine-tunes every weight, distilled from the unpruned base; ``qat`` is ``distill`` with the quantization
moved before that fine-tune, which then trains through the quantizers. Otherwise the weights of the Linear layers and of
the embedding tables are quantized to sampled MXINT widths (the tables are half of MiniLM's weights:
without them no configuration gets 8x smaller). Objectives: accuracy, total weight bits and latency;
the constraint: accuracy drops at most one point. Hand-picked configurations are evaluated first (lora:
the tutorial's uniform 8 and 4 bits; distill: three pruned 4/6-bit guesses), and the tutorial's pick,
uniform post-training quantization, is measured beside the search. The feasible Pareto points are
rebuilt from their parameters and exported as fxforge checkpoints.

``--time-to-target`` searches blind instead (nothing enqueued by hand, no tutorial picks): one objective,
``target_score`` (examples/search_targets.py: accuracy within a point of fp32 on the held-out reviews, >= 8x
smaller by packed checkpoint bytes, >= 2x faster timed interleaved with fp32), TPE, optionally the sensitivity
prior (``--prior sensitivity``: per-layer widths and pruning ratios shaped by one measurement, its allocations
queued by the prior) and a multi-fidelity pruner over fine-tune rungs (``--pruner hyperband``), ``--workers N``
processes on the run directory's journal, stopped at ``--timeout`` seconds of wall time after the study is
created; ``time_to_target.json`` gives each trial's finish time, the targets it met, and the time the first
trial met all three.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import optuna  # noqa: E402
import torch  # noqa: E402

from fxforge import ForgeGraph  # noqa: E402
from fxforge.benchmarks.minilm_imdb import finetuned_minilm, imdb_task  # noqa: E402
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


RECIPES = ("lora", "distill", "qat")


def space(recipe: str = "lora", prior: str | None = None) -> JointSpace:
    """``lora``: L1 pruning, LoRA of a sampled rank recovers, fused; ``distill``: taylor pruning (calibrated
    on training reviews), then every weight fine-tuned, distilled from the unpruned base, then MXINT weights;
    ``qat``: taylor pruning, MXINT weights, then the distilled fine-tune through the quantizers. With
    ``prior="sensitivity"`` the pruning ratios per group and the widths per layer are shaped by the prior."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {list(RECIPES)}, got {recipe!r}")
    pruning = PruningSpace([0.0, 0.25, 0.5, 0.75], groups={"ffn": FFN, "heads": HEADS},
                           granularity={"ffn": "ffn", "heads": "head"}, shrink=True,
                           method="l1" if recipe == "lora" else "taylor", finetune=recipe != "lora", prior=prior)
    precision = precision_space(qat=recipe == "qat", prior=prior)
    if recipe != "lora":
        return JointSpace(pruning, precision)
    return JointSpace(pruning, LoRARankSpace([8, 16, 32], targets={"type": ["linear"]},
                                             trainable={"name": ["classifier"]}), precision)


def precision_space(qat: bool = False, prior: str | None = None) -> MixedPrecisionSpace:
    """MXINT widths for the Linear weights and for the embedding tables, one choice per layer type (per layer
    with a prior, which allocates widths layer by layer)."""
    return MixedPrecisionSpace({"mxint": {"width": WIDTHS}}, roles=("weight",), per="layer" if prior else "type",
                               targets=("linear", "embedding"), qat=qat, prior=prior)


def uniform(width: int, recipe: str = "lora", ffn: float = 0.0, heads: float = 0.0,
            embedding: int | None = None) -> dict[str, object]:
    """A hand-picked configuration: every weight at ``width`` bits (the tables at ``embedding`` bits if given;
    by default nothing pruned, the tutorial's pick), the smallest LoRA rank in the lora recipe."""
    params: dict[str, object] = {"sparsity:ffn": ffn, "sparsity:heads": heads, "linear:mxint:weight_width": width,
                                 "embedding:mxint:weight_width": width if embedding is None else embedding}
    return {**params, "lora:rank": 8} if recipe == "lora" else params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--max-length", type=int, default=128, help="tokens kept per review")
    p.add_argument("--trial-train-size", type=int, default=None,
                   help="reviews each trial fine-tunes on (default: --train-size)")
    p.add_argument("--run-dir", default="out/search-joint")
    p.add_argument("--timeout", type=float, default=2 * 3600, help="stop after this many seconds")
    p.add_argument("--recipe", choices=RECIPES, default="lora",
                   help="how a pruned trial recovers: LoRA (lora), a distilled full fine-tune (distill), or that "
                        "fine-tune through the quantizers (qat)")
    p.add_argument("--trial-lr", type=float, default=None,
                   help="learning rate of the trials' fine-tune (default 3e-4 for LoRA, 1e-4 for distill)")
    p.add_argument("--sampler", default=None, help="default: nsga2 (tpe with --time-to-target)")
    p.add_argument("--export", type=int, default=3, help="rebuild and export this many smallest feasible points")
    p.add_argument("--export-trials", type=int, nargs="+", default=None,
                   help="rebuild and export these trials instead (e.g. after --resume of a finished search)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--base-dir", default=None, help="where the fine-tuned base is cached (default: --run-dir)")
    p.add_argument("--time-to-target", action="store_true",
                   help="search blind for a point meeting the three targets and report when it was found")
    p.add_argument("--prior", choices=("none", "sensitivity"), default="none")
    p.add_argument("--pruner", choices=("none", "successive_halving", "hyperband"), default="none",
                   help="multi-fidelity pruner over --fidelity-steps (one objective: --time-to-target)")
    p.add_argument("--fidelity-steps", type=int, nargs="+", default=None,
                   help="fine-tune steps per rung (default with a pruner: 15 45 135)")
    p.add_argument("--fidelity-samples", type=int, nargs="+", default=None,
                   help="held-out reviews per rung (default with a pruner: 1/5, 2/5 and all of --eval-size)")
    p.add_argument("--calibration-size", type=int, default=32,
                   help="training reviews the sensitivity prior and taylor pruning score on (--time-to-target)")
    p.add_argument("--workers", type=int, default=1, help="worker processes on the run directory's journal")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="end the run when a trial meets all three targets (--time-to-target)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # set by the launching process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time_to_target:
        return run_to_target(args, list(sys.argv[1:] if argv is None else argv), p)
    if args.pruner != "none" or args.workers != 1:
        p.error("--pruner and --workers need --time-to-target (one objective, a journal shared by the workers)")
    run = Path(args.run_dir)
    base = finetuned_minilm(Path(args.base_dir or run), imdb_task(args.train_size, args.eval_size, args.max_length))
    # the trials' short fine-tune: LoRA wants a larger step than the base's full fine-tune
    task = trial_task(args, base)
    if args.recipe != "lora":
        enqueue = [uniform(4, args.recipe, 0.5, 0.25), uniform(4, args.recipe, 0.75, 0.25),
                   uniform(6, args.recipe, 0.5, 0.5)]
        if args.recipe == "qat":  # session 10's distill run: 8-bit Linear, 4-bit tables met size and speed
            enqueue = [uniform(8, "qat", 0.75, 0.5, embedding=4), uniform(4, "qat", 0.75, 0.5),
                       uniform(6, "qat", 0.5, 0.5, embedding=4), *enqueue[:2]]
    else:
        enqueue = [uniform(8), uniform(4)]
    for width in (8, 4):
        tutorial_pick(base, task, width)
    prior = None if args.prior == "none" else args.prior
    result = Search(space(args.recipe, prior), ["accuracy", "weight_bits", "latency_ms"], base=base, task=task,
                    n_trials=args.trials, sampler=args.sampler or "nsga2", seed=args.seed,
                    constraints=[Constraint("accuracy", max_drop=0.01)], run_dir=run, study_name=f"joint-{args.recipe}",
                    resume=args.resume, timeout=args.timeout, enqueue=[] if prior else enqueue).run()
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
    if args.export_trials is not None:
        by_number = {t.number: t for t in result.completed()}
        unknown = sorted(set(args.export_trials) - set(by_number))
        if unknown:
            p.error(f"--export-trials: no completed trial(s) {unknown}; completed: {sorted(by_number)}")
        chosen = [by_number[n] for n in args.export_trials]
    paths = result.export(run / "pareto", chosen)  # rebuilt from their parameters (fine-tune replayed)
    print(f"exported: {[str(p) for p in paths]}")
    if paths:
        remeasure(base, task, paths, [t.values[0] for t in chosen])
    return 0


def trial_task(args: argparse.Namespace, base: ForgeGraph) -> TextClassificationTask:
    """The task the trials fine-tune and are measured with (distilled from the unpruned base but for lora)."""
    lr = args.trial_lr if args.trial_lr is not None else (3e-4 if args.recipe == "lora" else 1e-4)
    task = imdb_task(args.trial_train_size or args.train_size, args.eval_size, args.max_length, lr=lr)
    if args.recipe != "lora":  # data by reference: the teacher is the unpruned base, not part of the plan
        task.train_args.update(teacher=base, distill={"alpha": 0.5, "temperature": 2.0})
    return task


def run_to_target(args: argparse.Namespace, argv: list[str], p: argparse.ArgumentParser) -> int:
    """``--time-to-target``: create the study (sensitivity and baseline measured once), run ``--workers``
    processes on its journal until ``--timeout`` s after the start, then write time_to_target.json."""
    from fxforge.examples.search_targets import (
        SCORE,
        Reference,
        Targets,
        target_objective,
        time_to_target,
        write_report,
    )
    from fxforge.examples.search_workers import run_workers
    from fxforge.search import Fidelity, StorageSpec
    from fxforge.search.priors import apply_prior
    from fxforge.search.runner import trial_result
    from fxforge.search.storage import open_storage

    if args.workers < 1 or (args.threads is not None and args.threads < 1):
        p.error("--workers and --threads must be >= 1")
    if args.export_trials is not None and not (args.resume and (Path(args.run_dir) / "time_to_target.json").is_file()):
        p.error("--export-trials with --time-to-target rebuilds trials of a finished run: pass --resume and the "
                "--run-dir holding its time_to_target.json")
    fidelity = None
    if args.pruner != "none" or args.fidelity_steps or args.fidelity_samples:
        e = args.eval_size
        fidelity = Fidelity(steps=tuple(args.fidelity_steps or (15, 45, 135)),
                            eval_samples=tuple(args.fidelity_samples or (max(1, e // 5), max(2, 2 * e // 5), e)))
        if fidelity.eval_samples[-1] != e:
            p.error(f"--fidelity-samples: the last rung measures all --eval-size {e} reviews (the targets' set)")
    run = Path(args.run_dir)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    worker = args.worker is not None
    if worker or args.threads:  # a launching process measures the prior and the baseline with every core
        torch.set_num_threads(threads)  # unless told (on a loaded machine, threads waiting for each other crawl)
    base = finetuned_minilm(Path(args.base_dir or run), imdb_task(args.train_size, args.eval_size, args.max_length))
    task = trial_task(args, base)
    task.calibration_size = args.calibration_size
    if not worker and args.export_trials is None:
        start = time.time()  # the clock: the fine-tuned base is given, everything after it counts
        run.mkdir(parents=True, exist_ok=True)
        reference = Reference.measure(base, task)
        reference.write(run)
        print(f"fp32: accuracy {reference.accuracy:.3f} on {reference.eval_samples} held-out reviews, "
              f"{reference.weight_bytes:,.0f} weight bytes in its checkpoint")
    else:
        reference = Reference.read(run)

    def met(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:  # --stop-at-target, one process
        if args.stop_at_target and trial_result(trial).get("notes", {}).get(SCORE, {}).get("all_met"):
            study.stop()

    def any_met() -> bool:  # --stop-at-target, several processes: read the journal as it is now
        study = optuna.load_study(study_name=f"ttt-{args.recipe}", storage=open_storage(StorageSpec(), run))
        return any(trial_result(t).get("notes", {}).get(SCORE, {}).get("all_met") for t in study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))

    def search(resume: bool, fail_stale: bool, timeout: float | None) -> Search:
        prior = None if args.prior == "none" else args.prior
        return Search(space(args.recipe, prior), [target_objective(base, reference)], base=base, task=task,
                      n_trials=args.trials, sampler=args.sampler or "tpe", seed=args.seed,
                      pruner=None if args.pruner == "none" else args.pruner, fidelity=fidelity, run_dir=run,
                      study_name=f"ttt-{args.recipe}", resume=resume, fail_stale=fail_stale, timeout=timeout,
                      progress=not worker and args.workers == 1, on_trial=met, worker=args.worker)

    if args.export_trials is not None:  # a finished run's trials: rebuilt and exported, no trial run
        return export_target_trials(search(True, False, None), args.export_trials, run, base, p)
    if worker:  # Optuna starts no trial after the timeout; the launching process stops one still running
        search(True, False, max(1.0, args.deadline - time.time())).run()
        return 0
    first = search(args.resume, True, None)
    study = first.open_study()
    shaped, seeded = apply_prior(first.space.bind(base), study, base, first.task)  # measured once, stored
    for params in seeded:  # the prior's own allocations (nothing is enqueued by hand)
        study.enqueue_trial(dict(params), skip_if_exists=True)
    first.baseline(study)
    deadline = start + args.timeout
    setup = time.time() - start
    print(f"study ready after {setup:.0f} s ({len(seeded)} allocations queued by the prior); "
          f"{args.workers} worker(s) x {threads} thread(s) until {args.timeout:.0f} s")
    if args.workers == 1:
        search(True, False, max(1.0, deadline - time.time())).run()
    else:
        codes = run_workers(__spec__.name if __spec__ else "fxforge.examples.search_joint",
                            [*argv, "--deadline", repr(deadline), "--threads", str(threads)], args.workers, deadline,
                            run / "workers", threads, done=any_met if args.stop_at_target else None)
        print(f"workers' exit codes (None: stopped at the deadline): {codes}")
    study = search(True, False, None).open_study()  # read it as the workers left it
    report = time_to_target(study, start, args.timeout, Targets(), seed=args.seed, workers=args.workers,
                            threads_per_worker=threads, recipe=args.recipe, prior=args.prior, pruner=args.pruner,
                            fidelity=fidelity.to_json() if fidelity else None, setup_s=setup,
                            reference=reference.__dict__, wall_s=time.time() - start)
    write_report(report, run)
    return 0


def export_target_trials(search: Search, numbers: list[int], run: Path, base: ForgeGraph,
                         p: argparse.ArgumentParser) -> int:
    """Rebuild the given trials of a finished ``--time-to-target`` run (their fine-tune replayed at the last
    rung's budget) into ``run/pareto/trial_<n>``, and re-measure each one's accuracy on the targets' held-out
    set beside what its trial recorded: a rebuild that does not reproduce its trial says so."""
    from fxforge.examples.search_targets import SCORE
    from fxforge.search.results import SearchResult
    from fxforge.search.runner import OBJECTIVES_ATTR, trial_result

    study = search.open_study()
    by_number = {t.number: t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))}
    unknown = sorted(set(numbers) - set(by_number))
    if unknown:
        p.error(f"--export-trials: no completed trial(s) {unknown} in {run}; completed: {sorted(by_number)}")
    chosen = [by_number[n] for n in numbers]
    result = SearchResult(study, list(study.user_attrs.get(OBJECTIVES_ATTR, [])), search.baseline(study), search)
    paths = result.export(run / "pareto", chosen)
    task = search.task
    assert task is not None  # the time-to-target search is built with its task
    base_acc = task.accuracy(base)
    for trial, path in zip(chosen, paths):
        recorded = trial_result(trial).get("notes", {}).get(SCORE, {}).get("accuracy")
        acc = task.accuracy(ForgeGraph.from_checkpoint(path).eval())
        print(f"exported trial {trial.number} -> {path}: accuracy {acc:.3f} ({100 * (acc - base_acc):+.1f} points "
              f"from fp32 {base_acc:.3f}); the trial recorded {recorded if recorded is None else f'{recorded:.3f}'}")
    return 0


def tutorial_pick(base: ForgeGraph, task: TextClassificationTask, width: int) -> ForgeGraph:
    """What the tutorial does by hand: every weight (Linear and embedding) at ``width`` bits, no training."""
    from fxforge.search.objectives import weight_bits
    from fxforge.search.runner import apply_steps, trial_pipeline

    plan = precision_space().bind(base).suggest(optuna.trial.FixedTrial({"linear:mxint:weight_width": width,
                                                      "embedding:mxint:weight_width": width}))
    graph = apply_steps(base.copy(), trial_pipeline(plan.steps, f"uniform {width}"))
    base_acc = task.accuracy(base)
    acc = task.accuracy(graph)
    print(f"tutorial's pick, uniform MXINT{width} post-training: accuracy {acc:.3f} "
          f"({100 * (acc - base_acc):+.1f} points), weights {weight_bits(base) / weight_bits(graph):.2f}x smaller")
    return graph


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

    t = interleaved({name: functools.partial(forward, g) for name, g in graphs.items()}, repeats=7)
    base_acc, base_bits = task.accuracy(base), weight_bits(base)
    print(f"re-measured, interleaved (batch {labels.numel()} x {task.max_length}): "
          f"fp32 {1e3 * t.median('fp32'):.0f} ms, accuracy {base_acc:.3f}")
    for (name, g), searched in zip(list(graphs.items())[1:], accuracies):
        acc = task.accuracy(g)
        print(f"  {name}: accuracy {acc:.3f} (search: {searched:.3f}; {100 * (acc - base_acc):+.1f} points), "
              f"weights {base_bits / weight_bits(g):.2f}x smaller, {t.pair_ratio('fp32', name):.2f}x faster")


if __name__ == "__main__":
    raise SystemExit(main())
