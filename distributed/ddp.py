"""Data-parallel processes on torch.distributed: start N local ranks (torch's elastic launcher) or join the job
``torchrun`` started, one process group per job (gloo on CPU, NCCL with CUDA), and shard a batch so the ranks'
averaged gradients equal the single-process gradient of the whole batch.

Each rank gets ``threads`` intra-op threads (``torchrun`` sets OMP_NUM_THREADS=1, a spawned process does not:
two ranks with every core each oversubscribe the machine), and the process group gets a ``timeout``: a
SIGKILLed peer fails the others at once, but a frozen one would hang them for torch's default 30 minutes.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = ["DDPError", "DDPOptions", "init_group", "launch", "launched_by_torchrun", "shard_rows", "shard_weight"]


class DDPError(RuntimeError):
    """A distributed job could not start, or a rank of it failed (the message says which and how)."""


@dataclass(frozen=True)
class DDPOptions:
    """How to run a data-parallel job: ``nproc`` local ranks, each with ``threads`` threads (default: the cores
    shared out), a process group that gives up after ``timeout`` s without progress, and ``max_restarts``
    restarts of the whole group after a rank fails (what lets a search retry the trial a dead rank interrupted)."""

    nproc: int = 2
    timeout: float = 1800.0
    threads: int | None = None
    max_restarts: int = 1
    rdzv_endpoint: str | None = None  # HOST:PORT for several hosts; default a free port on 127.0.0.1
    nnodes: int = 1

    def __post_init__(self) -> None:
        """Refuse a setting no job could run with, before any process starts."""
        for name in ("nproc", "nnodes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise DDPError(f"ddp {name} must be an integer >= 1, got {value!r}")
        if type(self.max_restarts) is not int or self.max_restarts < 0:
            raise DDPError(f"ddp max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise DDPError(f"ddp timeout must be a number of seconds > 0, got {self.timeout!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise DDPError(f"ddp threads must be an integer >= 1, got {self.threads!r}")

    def rank_threads(self) -> int:
        """Threads per rank: as given, else this machine's cores shared out among the local ranks."""
        return self.threads or max(1, (os.cpu_count() or 1) // self.nproc)


def launched_by_torchrun() -> bool:
    """True in a process ``torchrun`` (or any elastic agent) started as one rank of a job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(options: DDPOptions) -> tuple[int, int]:
    """Join this rank's process group (once; gloo on CPU, NCCL with CUDA) with ``options.timeout`` and set its
    threads; returns ``(rank, world_size)``."""
    import torch.distributed as dist

    torch.set_num_threads(options.rank_threads())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=_attempt_store(rank, world, options.timeout), rank=rank,
                                world_size=world, timeout=timedelta(seconds=options.timeout))
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(rank: int, world: int, timeout: float) -> Any:
    """The job's key-value store under a prefix of this restart attempt: a group restarted after a rank failed
    keeps the launcher's store (and port), whose keys still hold the dead group's addresses; read through
    torch's default keys the new ranks would connect to those and time out."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the launcher hosts it (c10d rendezvous)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timedelta(seconds=timeout),
                          multi_tenant=not agent)
    return dist.PrefixStore(f"fxforge/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def launch(entry: Callable[..., Any], args: Sequence[Any], options: DDPOptions) -> dict[int, Any]:
    """Run ``entry(*args)`` on ``options.nproc`` local ranks through torch's elastic launcher (c10d rendezvous;
    the group is restarted up to ``max_restarts`` times after a rank fails); returns each local rank's return
    value. ``entry`` must be importable by a fresh process (a module-level function). A job whose ranks failed
    on every attempt is a DDPError naming the first failed rank and its exit."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    endpoint = options.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    config = LaunchConfig(min_nodes=options.nnodes, max_nodes=options.nnodes, nproc_per_node=options.nproc,
                          run_id=f"fxforge-{uuid.uuid4().hex[:12]}", rdzv_backend="c10d", rdzv_endpoint=endpoint,
                          rdzv_configs={"timeout": 900 if options.nnodes > 1 else 120},
                          max_restarts=options.max_restarts, monitor_interval=0.1, start_method="spawn")
    env = {"OMP_NUM_THREADS": str(options.rank_threads())}  # the ranks inherit it: torch reads it at import
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dict(elastic_launch(config, entry)(*args))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise DDPError(f"distributed job failed after {options.max_restarts} restart(s): rank {rank} "
                       f"{_describe(failure)}") from None
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _describe(failure: Any) -> str:
    """One line for an elastic ProcessFailure: its signal or exit code and, when recorded, its error."""
    message = getattr(failure, "message", "") or ""
    text = message.get("message", "") if isinstance(message, Mapping) else str(message)
    how = f"exited with {failure.exitcode}" if failure.exitcode >= 0 else f"was killed by signal {-failure.exitcode}"
    return f"{how}{': ' + text.splitlines()[0] if text.strip() else ''}"


def shard_rows(count: int, rank: int, world: int) -> slice:
    """The contiguous rows of a ``count``-row batch rank ``rank`` of ``world`` takes: sizes differ by at most
    one, and together the ranks take every row once, in order."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def shard_weight(count: int, rank: int, world: int) -> float:
    """The factor on a rank's mean loss over its shard so that DDP's average of the ranks' gradients is the
    gradient of the mean loss over the whole ``count``-row batch (``world * shard / count``; 1 for even shards)."""
    rows = shard_rows(count, rank, world)
    return world * (rows.stop - rows.start) / count
