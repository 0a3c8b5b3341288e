"""Search machinery overhead per trial, and scale-out over PostgreSQL workers, measured in one run.

    .venv/bin/python -m fxforge.benchmarks.bench_search            # all parts (about 5 minutes)
    .venv/bin/python -m fxforge.benchmarks.bench_search --part overhead

* overhead: per-trial time the search adds (sampling, storage, base-graph copy, plan cache lookup,
  bookkeeping) = wall time per trial minus the trial's own work (its pipeline and measurements),
  for the embedded journal and for PostgreSQL, in two settings: (a) a 16-parameter space on a small
  net, against a toy trial (PTQ of a tiny BERT on 256 samples) and plain Optuna's storage cost (an empty
  objective); (b) the mixed-precision example's own search (MiniLM, a width and fraction per role per
  Linear, NSGA-II, the MiniLM copied per trial), whose trial (PTQ + accuracy on 500
  reviews of 128 tokens) is the lightest trial of the examples: the others also train.
* cpu: 2 workers vs 1 on a CPU-bound objective (each 1 thread), next to the machine's own
  2-process/1-process throughput for the same CPU burn without Optuna, measured in the same run.
* coordination: 8 workers vs 1 with an objective that sleeps 1 s (work done elsewhere), >= 40 trials
  per worker. Workers are long-lived: each starts, connects and waits at a barrier; throughput is
  counted from the barrier, and the start-up cost is reported separately.
Every worker runs fxforge's own Search (storage with heartbeats, fresh copies, plan cache).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import optuna  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from fxforge import ForgeGraph  # noqa: E402
from fxforge.search import LocalPostgres, MixedPrecisionSpace, Objective, Search, TensorTask  # noqa: E402
from fxforge.search.objectives import avg_weight_bits  # noqa: E402
from fxforge.search.runner import trial_result  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
WIDE = MixedPrecisionSpace({"integer": {"width": list(range(2, 17)), "frac_width": [1, 2]}},
                           roles=("weight", "data_in"), per="layer")


def _net_graph() -> ForgeGraph:
    torch.manual_seed(0)
    net = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(16, 16), nn.ReLU())), nn.Linear(16, 3)).eval()
    return ForgeGraph(net, (torch.randn(4, 16),))


def _burn(seconds_of_work: int) -> None:
    """A fixed amount of single-threaded CPU work (matmuls)."""
    a = torch.randn(256, 256)
    for _ in range(seconds_of_work):
        a = torch.tanh(a @ a / 256)


def _objective(kind: str, amount: float) -> Objective:
    def measure(graph: ForgeGraph, task: object) -> float:
        if kind == "sleep":
            time.sleep(amount)
        elif kind == "burn":
            _burn(int(amount))
        return avg_weight_bits(graph)
    return Objective(f"{kind}_bits", "minimize", measure)


# -- part 1: overhead ---------------------------------------------------------------------------------
def _overhead(storage: str | None, run_dir: Path, n: int) -> tuple[float, float]:
    """(ms of machinery per trial, ms of trial work) over ``n`` trials of the wide space on a small net."""
    mg = _net_graph()
    x = torch.randn(256, 16)
    task = TensorTask({"input": x}, mg.model(x).argmax(-1), batch_size=256)
    return _machinery(Search(WIDE, ["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=n, sampler="tpe",
                             storage=storage, study_name=f"overhead-{time.time_ns()}", run_dir=run_dir,
                             progress=False, resume=True))


def _example_overhead(storage: str | None, run_dir: Path, n: int) -> tuple[float, float]:
    """(ms of machinery per trial, ms of trial work) over ``n`` trials of the mixed-precision example's search:
    its space and sampler on MiniLM, accuracy on 500 reviews' worth of 128-token inputs (the timing does not
    depend on the tokens, so random ids stand in for the reviews)."""
    from fxforge.models.bert import minilm_for_sequence_classification
    from fxforge.search import Constraint
    from fxforge.search.precision import TUTORIAL_FIXED_POINT

    base = ForgeGraph(minilm_for_sequence_classification().eval(), hf_input_names=["input_ids", "attention_mask"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (500, 128), generator=gen)
    task = TensorTask({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      torch.randint(0, 2, (500,), generator=gen), batch_size=32)
    space = MixedPrecisionSpace({"integer": TUTORIAL_FIXED_POINT}, roles=("data_in", "weight"), per="layer")
    print(f"  ({len(space.bind(base).keys()) * 4} parameters per trial)")
    return _machinery(Search(space, ["accuracy", "avg_weight_bits"], base=base, task=task, n_trials=n,
                             sampler="nsga2", constraints=[Constraint("accuracy", max_drop=0.01)], storage=storage,
                             study_name=f"example-{time.time_ns()}", run_dir=run_dir, progress=False, resume=True))


def _machinery(search: Search) -> tuple[float, float]:
    """(ms per trial the search spends outside the trials' own work, ms of that work); the baseline is
    measured before the clock starts (once per study, not per trial)."""
    search.baseline(search.open_study())
    start = time.perf_counter()
    result = search.run()
    wall = time.perf_counter() - start
    trials = result.completed()
    work = sum(trial_result(t)["timing_s"]["run"] + trial_result(t)["timing_s"]["measure"] for t in trials
               if "timing_s" in trial_result(t))
    return 1e3 * (wall - work) / len(trials), 1e3 * work / len(trials)


def _plain_optuna_ms(storage: str | None, run_dir: Path, n: int) -> float:
    from fxforge.search.storage import StorageSpec, open_storage

    study = optuna.create_study(storage=open_storage(StorageSpec(storage), run_dir),
                                study_name=f"plain-{time.time_ns()}")
    start = time.perf_counter()
    study.optimize(lambda t: t.suggest_int("x", 0, 1000), n_trials=n)
    return 1e3 * (time.perf_counter() - start) / n


def part_overhead(pg_url: str, n: int, example: int = 8) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        from fxforge.models.bert import tiny_bert
        from fxforge.search.precision import MixedPrecisionSpace as MPS

        bert = ForgeGraph(tiny_bert().eval(), hf_input_names=["input_ids", "attention_mask"])
        ids = torch.randint(0, 30522, (256, 64))
        task = TensorTask({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                          torch.randint(0, 2, (256,)), batch_size=64)
        typical = Search(MPS({"integer": {"width": [4, 8], "frac_width": [2, 3]}}), ["accuracy"], base=bert,
                         task=task, n_trials=3, sampler="random", run_dir=run / "typ", progress=False).run()
        work_typ = statistics.median(trial_result(t)["timing_s"]["run"] + trial_result(t)["timing_s"]["measure"]
                                     for t in typical.completed() if "timing_s" in trial_result(t)) * 1e3
        print(f"toy trial's own work (PTQ of tiny BERT + accuracy on 256 samples): {work_typ:.0f} ms")
        print("(a) 16-parameter space on a small net:")
        for label, url in (("journal (embedded)", None), ("postgresql", pg_url)):
            ms, work = _overhead(url, run / label.split()[0], n)
            plain = _plain_optuna_ms(url, run / ("plain" + label.split()[0]), n)
            print(f"  {label:20s}: machinery {ms:7.1f} ms/trial (plain Optuna storage alone {plain:6.1f} ms); "
                  f"= {100 * ms / work_typ:4.1f}% of the toy trial")
        print(f"(b) the mixed-precision example's search (MiniLM, {example} trials):")
        for label, url in (("journal (embedded)", None), ("postgresql", pg_url)):
            ms, work = _example_overhead(url, run / ("ex" + label.split()[0]), example)
            print(f"  {label:20s}: machinery {ms:7.1f} ms/trial; the trial's own work {work:6.0f} ms "
                  f"-> {100 * ms / work:4.1f}% (target <= 5%)")


# -- parts 2 and 3: scale-out ------------------------------------------------------------------------
def worker_main(url: str, study: str, n_trials: int, kind: str, amount: float, barrier: str) -> None:
    torch.set_num_threads(1)
    search = Search(WIDE, [_objective(kind, amount)], base=_net_graph(), n_trials=n_trials, sampler="random",
                    seed=None, storage=url, study_name=study, resume=True, progress=False)
    search.open_study()  # connected and ready
    Path(barrier + f".{os.getpid()}").touch()
    while not Path(barrier).exists():
        time.sleep(0.01)
    search.run()


def _run_workers(url: str, workers: int, trials: int, kind: str, amount: float) -> tuple[float, float]:
    """(trials per second after the barrier, start-up seconds) for ``workers`` processes."""
    study = f"{kind}-{workers}-{time.time_ns()}"
    Search(WIDE, [_objective(kind, amount)], base=_net_graph(), n_trials=trials, storage=url,
           study_name=study, progress=False).open_study()
    with tempfile.TemporaryDirectory() as tmp:
        barrier = str(Path(tmp) / "go")
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-m", "fxforge.benchmarks.bench_search", "--worker", url, study,
                                   str(trials), kind, str(amount), barrier]) for _ in range(workers)]
        while len(list(Path(tmp).glob("go.*"))) < workers:
            time.sleep(0.02)
        startup = time.perf_counter() - t0
        start = time.perf_counter()
        Path(barrier).touch()
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError("a worker failed")
        elapsed = time.perf_counter() - start
    done = optuna.load_study(study_name=study, storage=url)
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in done.trials)
    return complete / elapsed, startup


def _pure_burn(processes: int, amount: int, repeats: int) -> float:
    """Work units per second of ``processes`` concurrent pure-torch burners (no Optuna)."""
    code = ("import torch,sys;torch.set_num_threads(1);from fxforge.benchmarks.bench_search import _burn;"
            f"[_burn({amount}) for _ in range({repeats})]")
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    for p in procs:
        p.wait()
    return processes * repeats / (time.perf_counter() - start)


def part_cpu(url: str, amount: int, trials: int) -> None:
    one, _ = _run_workers(url, 1, trials, "burn", amount)
    two, _ = _run_workers(url, 2, 2 * trials, "burn", amount)
    m1, m2 = _pure_burn(1, amount, trials), _pure_burn(2, amount, trials)
    ratio, machine = two / one, m2 / m1
    print(f"cpu-bound: 1 worker {one:.2f} trials/s, 2 workers {two:.2f} trials/s -> {ratio:.2f}x; machine's own "
          f"2-process ratio {machine:.2f}x; fxforge reaches {100 * ratio / machine:.0f}% of it (target >= 90%)")


def part_coordination(url: str, per_worker: int) -> None:
    one, s1 = _run_workers(url, 1, per_worker, "sleep", 1.0)
    eight, s8 = _run_workers(url, 8, 8 * per_worker, "sleep", 1.0)
    print(f"coordination (1 s sleep, {per_worker} trials/worker): 1 worker {one:.3f} trials/s, 8 workers "
          f"{eight:.3f} trials/s -> {eight / one:.2f}x (target >= 7x); start-up before the barrier "
          f"{s1:.1f} s (1 worker), {s8:.1f} s (8 workers)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "overhead", "cpu", "coordination"], default="all")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--example-trials", type=int, default=8, help="trials of the example's search per storage")
    parser.add_argument("--burn", type=int, default=60, help="CPU work units per CPU-bound trial")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        url, study, n, kind, amount, barrier = args.worker
        worker_main(url, study, int(n), kind, float(amount), barrier)
        return 0
    print(f"load average at start: {os.getloadavg()}")
    with LocalPostgres(max_connections=200) as pg:
        if args.part in ("all", "overhead"):
            part_overhead(pg.url, args.trials, args.example_trials)
        if args.part in ("all", "cpu"):
            part_cpu(pg.url, args.burn, max(8, args.trials // 4))
        if args.part in ("all", "coordination"):
            part_coordination(pg.url, args.trials)
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
