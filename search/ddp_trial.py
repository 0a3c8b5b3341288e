"""Distributed trials: each trial's fine-tune runs data-parallel on N ranks (DDP), one Optuna worker per job.

Rank 0 is the search worker: it alone opens the study, samples, measures and reports (one ``tell`` per trial,
the same parameters and values as a single-process worker). When a trial trains, rank 0 broadcasts the
trial's parameters and plan; every other rank builds the same graph from the plan, trains its shard
(:class:`~fxforge.search.ddp_task.DDPTask`) and returns what it trained on to rank 0, which records it in the
trial (user attribute ``fxforge_ddp``). When the search ends rank 0 broadcasts a stop.

A rank that dies mid-trial breaks the group: rank 0's trial fails (Optuna marks it FAIL), rank 0 re-queues it
with its parameters (Optuna's retry semantics, at most the storage's ``max_retry`` times) and exits, and the
launcher restarts the group, which resumes the study and runs the retried trial. If rank 0 itself dies the
trial is left RUNNING and the resume (journal) or the heartbeat (databases) fails and re-queues it, as for a
killed single-process worker. Started by ``ddp_search`` / ``fxforge search ... --ddp N`` (torch's elastic
launcher, N local ranks) or joined under ``torchrun``.
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import optuna

from ..distributed.ddp import DDPOptions, init_group, launch, launched_by_torchrun
from .ddp_task import DDPTask
from .errors import SearchError
from .results import plan_from_json
from .runner import PLAN_ATTR, Search, apply_steps, plan_pipelines

if TYPE_CHECKING:
    from .results import SearchResult

__all__ = ["DDP_ATTR", "ConfigSearch", "ObjectGroup", "RankStopped", "StudySearch", "TrialChannel", "ddp_config",
           "ddp_search", "ddp_worker"]

DDP_ATTR = "fxforge_ddp"  # per trial: world size and what each rank trained on


class RankStopped(RuntimeError):
    """Rank 0 was told to stop (SIGTERM from the launcher after another rank failed) in the middle of a trial."""


class ObjectGroup(Protocol):
    """What the trial protocol needs of a process group: this rank, the size, and two object collectives."""

    rank: int
    world_size: int

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0 (None elsewhere)."""


class TorchGroup:
    """The default torch.distributed group as an :class:`ObjectGroup` (pickled objects over gloo/NCCL)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.world_size = dist, dist.get_rank(), dist.get_world_size()

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0)
        return out


@dataclass
class TrialChannel:
    """The trial protocol over ``group``: rank 0 announces each training trial (its number, parameters and
    plan) or the end; the others receive it, train, and send their status back."""

    group: ObjectGroup

    def announce(self, trial: optuna.Trial) -> None:
        """Rank 0: the trial every rank trains now (its plan was stored by the search before any work)."""
        self.group.broadcast({"op": "train", "number": trial.number, "params": dict(trial.params),
                              "plan": dict(trial.user_attrs[PLAN_ATTR])})

    def stop(self) -> None:
        """Rank 0: no more trials; the other ranks return."""
        self.group.broadcast({"op": "stop"})

    def receive(self) -> dict[str, Any] | None:
        """Another rank: the next trial to train, or None at the end."""
        message = self.group.broadcast(None)
        return None if message["op"] == "stop" else dict(message)

    def collect(self, status: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's status after training, on rank 0 (in rank order)."""
        return self.group.gather(status)


@dataclass
class _Leader:
    """Rank 0's side: notes the trial being evaluated (its plan is needed even when a multi-objective search
    trains without a trial), announces it when it trains, collects the ranks' statuses into it, and re-queues
    a trial that failed while the ranks trained together or that the launcher stopped (another rank died)."""

    channel: TrialChannel
    evaluate: Callable[[optuna.Trial], Any]
    current: optuna.Trial | None = None
    failed: optuna.Trial | None = None  # the trial a dead rank interrupted (to re-queue)
    in_collective: bool = False
    stopping: dict[str, bool] = field(default_factory=lambda: {"masked": False, "deferred": False})

    def trial_evaluate(self, trial: optuna.Trial) -> Any:
        """The search's own evaluation of ``trial``, noting it (and, on a failure mid-training, keeping it)."""
        self.current = trial
        try:
            return self.evaluate(trial)
        except BaseException as exc:
            if self.in_collective or isinstance(exc, RankStopped):  # a rank died: the trial itself was sound
                self.stopping["masked"] = True  # from here to the re-queue a launcher's SIGTERM waits
                self.failed = trial
            raise

    def on_start(self) -> None:
        """Before rank 0 trains: every rank learns the trial (it builds the same graph from its plan)."""
        if self.current is None:
            raise SearchError("a distributed trial trains only inside the search's evaluation of a trial")
        self.in_collective = True
        self.channel.announce(self.current)

    def on_end(self, status: dict[str, Any]) -> None:
        """After training: every rank's status, recorded in the trial by rank 0."""
        statuses = self.channel.collect(status)
        self.in_collective = False
        if self.current is not None:
            self.current.set_user_attr(DDP_ATTR, {"world_size": self.channel.group.world_size, "ranks": statuses})

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """The launcher stops rank 0 after another rank failed: fail the trial, unless it is already failing."""
        if self.stopping["masked"]:
            self.stopping["deferred"] = True
            return
        raise RankStopped("stopped by the launcher (another rank failed)")

    def requeue(self, max_retry: int) -> None:
        """The interrupted trial, now FAIL, again as WAITING with its parameters (Optuna's retry callback)."""
        if self.failed is None:
            return
        study, number = self.failed.study, self.failed.number
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
        if frozen.state != optuna.trial.TrialState.FAIL:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)(study, frozen)


def _check_search(search: Search) -> None:
    """Refuse what a distributed trial cannot do: pruning mid-training or fidelity rungs (ranks would diverge)."""
    if search.pruner not in (None, "none") or search.fidelity is not None:
        raise SearchError("distributed trials (--ddp) report once per trial: drop the pruner and the fidelity "
                          "schedule, or run single-process")


def _lead(search: Search, inner: Any, channel: TrialChannel, options: DDPOptions) -> None:
    """Rank 0: run the search, each training trial shared with the other ranks; stop them at the end."""
    leader = _Leader(channel, search.evaluate)
    search.task = DDPTask(inner, 0, channel.group.world_size, options.timeout, leader.on_start, leader.on_end)
    search.evaluate = leader.trial_evaluate  # type: ignore[method-assign]  # run() optimises through it
    previous = signal.signal(signal.SIGTERM, leader.on_sigterm)
    try:
        search.run()
    except BaseException:
        leader.stopping["masked"] = True
        leader.requeue(search.storage_spec().max_retry)
        if leader.failed is None:  # failed outside the ranks' shared work: they wait for a message, say stop
            _try(channel.stop)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    channel.stop()


def _follow(search: Search, inner: Any, channel: TrialChannel, options: DDPOptions) -> None:
    """Any other rank: build and train each announced trial's graph with rank 0 until it says stop."""
    group = channel.group
    task = DDPTask(inner, group.rank, group.world_size, options.timeout, on_end=channel.collect)
    while (message := channel.receive()) is not None:
        plan = plan_from_json(message["plan"])
        graph = search.start_graph(plan)
        before, _ = plan_pipelines(plan, task, graph, f"trial {message['number']}")
        task.train(apply_steps(graph, before), None)


def _try(fn: Callable[[], Any]) -> None:
    """``fn()`` when the group still works; nothing when it is broken (the other ranks then fail by themselves)."""
    try:
        fn()
    except Exception:
        pass


def run_rank(make_search: Callable[[], Search], options: DDPOptions) -> None:
    """One rank of a distributed search (the launcher's entry point): join the group, build the search, lead
    (rank 0) or follow."""
    import torch.distributed as dist

    rank, _ = init_group(options)
    search = make_search()
    _check_search(search)
    if search.task is None:
        raise SearchError("distributed trials fine-tune data-parallel: pass a task that trains")
    (_lead if rank == 0 else _follow)(search, search.task, TrialChannel(TorchGroup()), options)
    dist.destroy_process_group()  # after a failure the process exits instead: a broken group may not close


def ddp_search(make_search: Callable[[], Search], options: DDPOptions | None = None) -> SearchResult | None:
    """Run the search ``make_search()`` builds with each trial's fine-tune data-parallel on ``options.nproc``
    local ranks (started here), or as this rank of the job when started under ``torchrun``. ``make_search``
    must be importable by a fresh process (a module-level function or a :class:`ConfigSearch`) and build the
    same search on every rank (``resume=True`` lets a restarted group continue). Returns the SearchResult
    (on rank 0 under torchrun; None on the other ranks)."""
    options = options or DDPOptions()
    if launched_by_torchrun():
        run_rank(make_search, options)
        return _result(make_search()) if os.environ["RANK"] == "0" else None
    search = make_search()  # built here first: a search no rank could run is refused before any process starts
    _check_search(search)
    launch(run_rank, (make_search, options), options)
    return _result(search)


def ddp_config(config: dict[str, Any], options: DDPOptions, **kwargs: Any) -> SearchResult | None:
    """``fxforge search CONFIG.toml --ddp N``: the config's search with distributed trials (``kwargs`` as for
    :func:`~fxforge.search.config.search_from_config`)."""
    return ddp_search(ConfigSearch(dict(config), kwargs), options)


def ddp_worker(study_name: str, storage: str, options: DDPOptions, **overrides: Any) -> SearchResult | None:
    """``fxforge search worker --storage URL --study NAME --ddp N``: one more worker of a shared study whose
    trials each train data-parallel on N ranks."""
    from .storage import StorageSpec

    if StorageSpec(storage).kind == "journal":
        raise SearchError("workers share a study through a database: pass storage='postgresql://…' (or sqlite:///…)")
    return ddp_search(StudySearch(study_name, storage, dict(overrides)), options)


def _result(search: Search) -> SearchResult:
    """The study the ranks ran, read back as a SearchResult (n_trials reached: nothing runs again)."""
    from .results import SearchResult
    from .runner import BASELINE_ATTR, OBJECTIVES_ATTR
    from .storage import open_storage

    storage = open_storage(search.storage_spec(), Path(search.run_dir))
    study = optuna.load_study(study_name=search.study_name, storage=storage)
    return SearchResult(study, study.user_attrs[OBJECTIVES_ATTR], study.user_attrs.get(BASELINE_ATTR, {}), search)


@dataclass(frozen=True)
class ConfigSearch:
    """A picklable builder of the search a config describes (``fxforge search CONFIG.toml --ddp N``); ranks
    other than 0 build it without resuming, so they never open the study."""

    config: dict[str, Any]
    kwargs: dict[str, Any]

    def __call__(self) -> Search:
        from .config import search_from_config

        return search_from_config(self.config, **{**self.kwargs, **_follower_overrides()})


@dataclass(frozen=True)
class StudySearch:
    """A picklable builder of a shared study's search (``fxforge search worker ... --ddp N``): rank 0 reads the
    config stored in the study and broadcasts it, so only rank 0 talks to the storage."""

    study_name: str
    storage: str
    overrides: dict[str, Any]

    def __call__(self) -> Search:
        from .config import search_from_config
        from .worker import study_config

        grouped = _in_group()
        config = study_config(self.study_name, self.storage) if not grouped or grouped[0] == 0 else None
        if grouped:
            config = TorchGroup().broadcast(config)
        if config is None:
            raise SearchError(f"study {self.study_name!r}: rank 0 sent no config")
        return search_from_config(config, storage=self.storage, study_name=self.study_name,
                                  allow_outside_root=True, **{**self.overrides, "resume": True,
                                                              **_follower_overrides()})


def _in_group() -> tuple[int, int] | None:
    """(rank, world size) inside an initialised process group, else None (e.g. the launching process)."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None


def _follower_overrides() -> dict[str, Any]:
    """Settings for a rank other than 0: it never opens the study (no resume check reading the storage)."""
    grouped = _in_group()
    return {"resume": False} if grouped and grouped[0] != 0 else {}
