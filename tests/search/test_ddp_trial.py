"""Distributed trials (issue 32, item 4): each trial's fine-tune data-parallel on 2 gloo ranks, rank 0 the only
one that talks to the study (one report per trial, the same parameters and values as a single-process run of
the same trials), and a rank SIGKILLed mid-trial ending in a failed trial retried with its parameters.

The protocol and the batch sharding are checked here without processes; the launches (10-15 s each for
``import torch`` and the rendezvous) are marked slow: one module-scoped 2-rank search, and one killed rank."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyMLP

from fxforge.distributed.ddp import DDPError, DDPOptions, shard_rows, shard_weight
from fxforge.search import SearchError, TensorTask
from fxforge.search.ddp_task import DDPTask
from fxforge.search.ddp_trial import DDP_ATTR, TrialChannel

TESTS = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import functools, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import torch
    import torch.nn.functional as F
    from conftest import tiny_search_setup
    from fxforge.distributed.ddp import DDPOptions
    from fxforge.search import Objective, PruningSpace, Search, TensorTask
    from fxforge.search.ddp_trial import ddp_search
    from fxforge.search.task import logits_of

    ENQUEUE = [{{"sparsity:fc1": 0.25}}, {{"sparsity:fc1": 0.5}}, {{"sparsity:fc1": 0.0}}]

    def eval_loss(graph, task):
        """Mean cross-entropy on the held-out rows: continuous, so it shows float-level differences."""
        with torch.no_grad():
            batches = task.eval_batches()
            total = sum(F.cross_entropy(logits_of(graph.model(**x)), y, reduction="sum") for x, y in batches)
        return float(total) / sum(len(y) for _, y in batches)

    def make_search(run_dir, storage, steps, n_trials):
        if "RANK" in os.environ:  # which process is which rank (the killed-rank test signals rank 1)
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            Path(run_dir, f"rank{{os.environ['RANK']}}.pid").write_text(str(os.getpid()))
        torch.set_num_threads(1)
        mg, held_out = tiny_search_setup(99)
        x = torch.cat([b[0]["x"] for b in held_out.eval_batches()])
        y = torch.cat([b[1] for b in held_out.eval_batches()])
        gen = torch.Generator().manual_seed(1)
        noisy = x + 0.5 * torch.randn(x.shape, generator=gen)  # training rows the model does not fit yet
        labels = torch.randint(0, 3, (99,), generator=gen)
        task = TensorTask({{"x": x}}, y, batch_size=33, training=({{"x": noisy}}, labels), train_steps=steps,
                          learning_rate=0.2)  # batches of 33 rows: shards of 17 and 16
        space = PruningSpace([0.0, 0.25, 0.5], groups={{"fc1": {{"name": ["fc1"]}}}}, granularity="row",
                             shrink=True, finetune=True)
        return Search(space, ["accuracy", Objective("eval_loss", "minimize", eval_loss, needs_task=True)], base=mg,
                      task=task, n_trials=n_trials, sampler="random", storage=storage, study_name="ddp",
                      run_dir=run_dir, resume=True, progress=False, prefix_cache=False, enqueue=ENQUEUE[:n_trials])

    if __name__ == "__main__":
        run_dir, storage = sys.argv[1], sys.argv[2]
        steps, n_trials, restarts = map(int, sys.argv[3:6])
        result = ddp_search(functools.partial(make_search, run_dir, storage, steps, n_trials),
                            DDPOptions(nproc=2, threads=1, timeout=30, max_restarts=restarts))
        if result is not None:  # rank 0 (or the launching process) reports
            print(result.table())
''')


# -- without processes ---------------------------------------------------------------------------------------
def test_shards_average_to_the_whole_batch_gradient() -> None:
    """Each rank's weighted shard loss, averaged over ranks as DDP does, has the whole batch's gradient, also when
    the shards are uneven (33 rows on 2 and 4 ranks); the shards cover every row once, in order."""
    torch.manual_seed(0)
    net, x, y = TinyMLP(), torch.randn(33, 8), torch.randint(0, 3, (33,))
    whole = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    for world in (2, 4):
        parts = [shard_rows(33, r, world) for r in range(world)]
        assert [i for p in parts for i in range(p.start, p.stop)] == list(range(33))
        assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) == 1
        summed = [torch.zeros_like(p) for p in net.parameters()]
        for r, part in enumerate(parts):
            loss = F.cross_entropy(net(x[part]), y[part]) * shard_weight(33, r, world)
            for acc, g in zip(summed, torch.autograd.grad(loss, list(net.parameters()))):
                acc += g / world
        for a, b in zip(summed, whole):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert shard_weight(32, 1, 2) == 1.0


class _ThreadGroup:
    """An in-memory ObjectGroup for ranks running as threads (pickling-free collectives over a barrier)."""

    def __init__(self, rank: int, world: int, shared: dict[str, Any], barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self.shared, self.barrier = rank, world, shared, barrier

    def broadcast(self, obj: Any) -> Any:
        if self.rank == 0:
            self.shared["box"] = obj
        self.barrier.wait()
        out = self.shared["box"]
        self.barrier.wait()
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        self.shared[f"g{self.rank}"] = obj
        self.barrier.wait()
        out = [self.shared[f"g{r}"] for r in range(self.world_size)] if self.rank == 0 else None
        self.barrier.wait()
        return out


def test_rank0_alone_reports_and_the_others_receive_the_trial() -> None:
    """Over the trial protocol, rank 0 tells the study once per trial; the other ranks get each trial's number,
    parameters and plan, and their statuses reach rank 0 in rank order; a stop ends them."""
    world, barrier, shared = 3, threading.Barrier(3, timeout=20), {}  # type: int, threading.Barrier, dict[str, Any]
    study = optuna.create_study()
    received: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    collected: list[Any] = []

    def follower(rank: int) -> None:
        channel = TrialChannel(_ThreadGroup(rank, world, shared, barrier))
        while (message := channel.receive()) is not None:
            received[rank].append(message)
            channel.collect({"rank": rank, "rows": 10 * rank})

    threads = [threading.Thread(target=follower, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    leader = TrialChannel(_ThreadGroup(0, world, shared, barrier))
    for _ in range(2):
        trial = study.ask()
        trial.suggest_categorical("w", [4, 8])
        trial.set_user_attr("fxforge_plan", {"steps": [], "train": True})
        leader.announce(trial)
        collected.append(leader.collect({"rank": 0, "rows": 0}))
        study.tell(trial, 1.0)
    leader.stop()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert len(study.trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    for rank in (1, 2):
        assert [m["number"] for m in received[rank]] == [0, 1]
        assert [m["params"] for m in received[rank]] == [t.params for t in study.trials]
        assert all(m["plan"] == {"steps": [], "train": True} for m in received[rank])
    assert collected == [[{"rank": r, "rows": 10 * r} for r in range(world)]] * 2


class _PeerGone:
    """A 2-rank group whose other rank died: the announcement goes out, collecting its status fails as gloo does."""

    rank, world_size = 0, 2

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any] | None:
        raise RuntimeError("Connection reset by peer")


def test_a_trial_whose_peer_died_fails_and_is_requeued_with_its_parameters() -> None:
    """Rank 0's side of a failure mid-training: Optuna fails the trial, rank 0 re-queues it once with the same
    parameters (Optuna's retry record), and a launcher's SIGTERM meanwhile waits instead of interrupting it."""
    from fxforge.search.ddp_trial import RankStopped, _Leader

    study = optuna.create_study()

    def evaluate(trial: optuna.Trial) -> float:
        trial.suggest_int("w", 2, 8)
        trial.set_user_attr("fxforge_plan", {"steps": [], "train": True})
        leader.on_start()  # what DDPTask.train does first, then trains, then reports its status
        leader.on_end({"rank": 0, "rows": 4})
        return 1.0

    leader = _Leader(TrialChannel(_PeerGone()), evaluate)
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        study.optimize(leader.trial_evaluate, n_trials=1)
    leader.on_sigterm(signal.SIGTERM, None)  # masked from the failure on: recorded, not raised
    assert leader.stopping["deferred"]
    leader.requeue(max_retry=3)
    failed, retry = study.trials
    assert failed.state == optuna.trial.TrialState.FAIL and retry.state == optuna.trial.TrialState.WAITING
    assert retry.params == failed.params and retry.system_attrs["failed_trial"] == failed.number
    healthy = _Leader(TrialChannel(_PeerGone()), evaluate)
    with pytest.raises(RankStopped):  # outside a failure the launcher's SIGTERM stops rank 0 at once
        healthy.on_sigterm(signal.SIGTERM, None)


def test_ddp_refuses_what_it_cannot_run() -> None:
    """Settings no job could run and tasks that train their own way are refused before any process starts."""
    with pytest.raises(DDPError, match="nproc must be an integer >= 1"):
        DDPOptions(nproc=0)
    with pytest.raises(DDPError, match="timeout must be a number of seconds > 0"):
        DDPOptions(timeout=0)

    class OwnTraining(TensorTask):
        def train(self, graph: Any, trial: Any, steps: Any = None, checkpoints: Any = (),
                  on_checkpoint: Any = None) -> None:
            pass

    x = torch.randn(4, 8)
    with pytest.raises(SearchError, match="OwnTraining trains its own way"):
        DDPTask(OwnTraining({"x": x}, torch.zeros(4, dtype=torch.long)), 0, 2, 10.0)


def test_cli_ddp_settings_are_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fxforge search ... --ddp N``: a rank count no job could run, and a worker on a journal file (one writer),
    are one-line errors before any process starts."""
    from fxforge.cli.app import main

    assert main(["search", str(tmp_path / "absent.toml"), "--ddp", "0"]) == 1
    assert "ddp nproc must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["search", "worker", "--storage", str(tmp_path / "s.journal"), "--study", "x", "--ddp", "2"]) == 1
    assert "workers share a study through a database" in capsys.readouterr().err


# -- 2-rank launches -----------------------------------------------------------------------------------------
def _launch(tmp: Path, run_dir: Path, steps: int, n_trials: int, restarts: int) -> subprocess.Popen:
    script = tmp / "ddp_search.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    return subprocess.Popen([sys.executable, str(script), str(run_dir), str(run_dir / "study.journal"), str(steps),
                             str(n_trials), str(restarts)], cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The launcher's output once it exited (killing its whole session if it outlived ``timeout``)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the distributed search hung past {timeout} s:\n{out.decode()[-3000:]}")
    return out.decode()


def _journal_study(run_dir: Path) -> optuna.Study:
    from fxforge.search.storage import StorageSpec, open_storage

    return optuna.load_study(study_name="ddp", storage=open_storage(StorageSpec(str(run_dir / "study.journal")),
                                                                    run_dir))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("ddp")
    proc = _launch(tmp, tmp / "ddp", steps=12, n_trials=3, restarts=0)
    out = _finish(proc, timeout=240)
    assert proc.returncode == 0, out[-3000:]
    return tmp, out


@pytest.mark.slow
def test_ddp_trials_match_a_single_process_run(ddp_run: tuple[Path, str]) -> None:
    tmp, _ = ddp_run
    study = _journal_study(tmp / "ddp")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    # both ranks trained every trial, each on its shard of every batch (17 + 16 rows of 33, 12 steps)
    for t in study.trials:
        ranks = t.user_attrs[DDP_ATTR]["ranks"]
        assert t.user_attrs[DDP_ATTR]["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
        assert [r["rows"] for r in ranks] == [17 * 12, 16 * 12]
    # one report per trial: every record of the journal was written by one process (rank 0), one COMPLETE each
    from optuna.storages.journal import JournalFileBackend

    logs = list(JournalFileBackend(str(tmp / "ddp" / "study.journal")).read_logs(0))
    assert len({log["worker_id"].rsplit("-", 1)[0] for log in logs}) == 1
    finished = [log for log in logs if log.get("state") == optuna.trial.TrialState.COMPLETE.value]
    assert len(finished) == 3 and len({log["trial_id"] for log in finished}) == 3
    # the same trials single-process: same parameters, values within float tolerance
    script = runpy.run_path(str(tmp / "ddp_search.py"), run_name="ddp_script")
    single = script["make_search"](str(tmp / "single"), str(tmp / "single" / "study.journal"), 12, 3).run().study
    assert [t.params for t in single.trials] == [t.params for t in study.trials]
    for a, b in zip(single.trials, study.trials):
        assert a.values[0] == b.values[0]  # accuracy
        assert b.values[1] == pytest.approx(a.values[1], rel=1e-5)  # eval loss after training
    assert len({round(t.values[1], 3) for t in study.trials}) == 3  # the trials differ: the check is not vacuous


@pytest.mark.slow
def test_a_rank_killed_mid_trial_fails_the_trial_and_it_is_retried(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed while the ranks train trial 0 together: rank 0's trial fails at once (gloo sees the
    peer gone), is re-queued with its parameters, the launcher restarts the group, which resumes the study and
    completes the retried trial; nothing stays RUNNING and every process exits within the bound."""
    from fxforge.search.runner import PLAN_ATTR

    run_dir = tmp_path / "ddp"
    proc = _launch(tmp_path, run_dir, steps=2500, n_trials=1, restarts=1)  # a trial trains for seconds
    deadline, running = time.time() + 180, None
    while time.time() < deadline and running is None:
        assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
        if (run_dir / "study.journal").exists() and (run_dir / "rank1.pid").exists():
            running = next((t.number for t in _journal_study(run_dir).get_trials(deepcopy=False)
                            if t.state == optuna.trial.TrialState.RUNNING and PLAN_ATTR in t.user_attrs), None)
        time.sleep(0.1)
    assert running is not None, "no trial started training within 180 s"
    time.sleep(0.5)  # inside the trial's training (2500 steps: 1.5-12 s)
    first = [int((run_dir / f"rank{r}.pid").read_text()) for r in (0, 1)]
    os.kill(first[1], signal.SIGKILL)
    out = _finish(proc, timeout=240)
    assert proc.returncode == 0, out[-3000:]
    study = _journal_study(run_dir)
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.number for t in failed] == [running], out[-3000:]
    with warnings.catch_warnings():  # retried_trial_number is Optuna-experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retried = [t for t in study.trials
                   if optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == running]
    assert len(retried) == 1 and retried[0].params == failed[0].params
    assert retried[0].state == optuna.trial.TrialState.COMPLETE and states.count(optuna.trial.TrialState.COMPLETE) == 1
    assert [r["rank"] for r in retried[0].user_attrs[DDP_ATTR]["ranks"]] == [0, 1]  # trained by the new group
    second = [int((run_dir / f"rank{r}.pid").read_text()) for r in (0, 1)]
    assert set(second).isdisjoint(first)  # the restarted group's processes
    for pid in (*first, *second):  # none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
