"""Pipeline-parallel runs of a checkpointed graph: ``pipeline_run`` (inference) and ``pipeline_train_step``.

The graph is cut into N stages by split_stages_transform_pass and each stage runs on its own rank under
``torch.distributed.pipelining`` (``PipelineStage`` per stage, ``ScheduleGPipe`` or ``Schedule1F1B`` over
microbatches), gloo on CPU and NCCL with CUDA. Called in a plain process, N local ranks are started through torch's
elastic launcher (distributed/ddp.py: a free port on 127.0.0.1, threads per rank = cores / N, a short process-group
timeout); called in a process ``torchrun`` started, this process is one rank of that job (several hosts:
``torchrun --nnodes ... --rdzv-endpoint ...`` on each). Rank 0 writes the outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .pipeline_rank import LOSSES, SCHEDULES, PipelineJob, RankReport

__all__ = ["PipelineError", "PipelineJob", "PipelineResult", "pipeline_job", "pipeline_run", "pipeline_train_step",
           "run_pipeline_jobs"]

_BALANCES = ("time", "memory", "params")


class PipelineError(RuntimeError):
    """A pipeline job could not start, or one of its ranks failed (the message says which and how)."""


@dataclass(frozen=True)
class PipelineResult:
    """What the job reports. ranks: each rank's report (only this rank's under torchrun); outputs: the graph's
    outputs by name (read back from the file rank 0 wrote, when there is one); loss: the last stage's mean loss;
    grads: every stage's parameter gradients by name (a training step)."""

    ranks: tuple[RankReport, ...]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def cuts(self) -> tuple[str, ...]:
        return self.ranks[0].cuts

    @property
    def held_shares(self) -> tuple[float, ...]:
        """Each rank's part of the graph's parameter bytes (the target: at most 1/N + 10%)."""
        return tuple(r.held_share for r in self.ranks)


def pipeline_job(checkpoint: str | Path, stages: int, inputs: str | Path | Mapping[str, torch.Tensor],
                 output: str | Path | None = None, *, schedule: str = "gpipe", microbatches: int | None = None,
                 balance: str = "time", timeout: float = 300.0, threads: int | None = None, target: str | None = None,
                 loss: str = "cross_entropy", kill_rank: int | None = None, split_embedding: bool = False
                 ) -> PipelineJob:
    """The job every rank runs (arguments as for :func:`pipeline_run`; ``target`` makes it a training step, see
    :func:`pipeline_train_step`), every argument checked before a process starts."""
    if split_embedding and target is not None:
        raise PipelineError("pipeline_train_step: split_embedding is for inference only (the lookups the other ranks "
                            "send to the first stage carry no gradient back, so their rows would get none): train "
                            "with the table whole")
    if type(stages) is not int or stages < 1:
        raise PipelineError(f"pipeline_run: stages must be an integer >= 1, got {stages!r}")
    if schedule not in SCHEDULES:
        raise PipelineError(f"pipeline_run: schedule {schedule!r} is not one of {SCHEDULES}")
    if balance not in _BALANCES:
        raise PipelineError(f"pipeline_run: balance {balance!r} is not one of {_BALANCES}")
    if loss not in LOSSES:
        raise PipelineError(f"pipeline_run: loss {loss!r} is not one of {LOSSES}")
    if microbatches is not None and (type(microbatches) is not int or microbatches < 1):
        raise PipelineError(f"pipeline_run: microbatches must be an integer >= 1, got {microbatches!r}")
    if not Path(checkpoint).is_dir():
        raise PipelineError(f"pipeline_run: no checkpoint directory at {checkpoint} (write one with ForgeGraph.export)")
    if isinstance(inputs, str | Path):
        if not Path(inputs).is_file():
            raise PipelineError(f"pipeline_run: no inputs file at {inputs} (a safetensors file of the graph's inputs "
                                "by name)")
        data: str | dict[str, torch.Tensor] = str(Path(inputs).resolve())
    else:
        data = {k: v.detach().cpu() for k, v in inputs.items()}
        if target is not None and target not in data:
            raise PipelineError(f"pipeline_train_step: target {target!r} is not among the inputs {sorted(data)}")
    _check_batch(data, microbatches or stages)
    if output is not None and not Path(output).resolve().parent.is_dir():
        raise PipelineError(f"pipeline_run: the output's directory {Path(output).parent} does not exist")
    return PipelineJob(checkpoint=str(Path(checkpoint).resolve()), stages=stages, inputs=data,
                       output=None if output is None else str(Path(output).resolve()), schedule=schedule,
                       microbatches=microbatches or 0, balance=balance, timeout=float(timeout), threads=threads,
                       target=target, loss=loss, kill_rank=kill_rank, split_embedding=bool(split_embedding))


def _check_batch(data: str | dict[str, torch.Tensor], microbatches: int) -> None:
    """Every input's batch (first) dimension must split into ``microbatches`` equal parts (the schedule chunks
    them so); refused here, before any process starts, rather than inside the ranks."""
    if isinstance(data, str):
        from safetensors.torch import load_file

        data = load_file(data)
    for name, tensor in data.items():
        rows = tensor.shape[0] if tensor.dim() else 0
        if rows % microbatches:
            raise PipelineError(f"pipeline_run: input {name!r} has a batch of {rows}, which {microbatches} "
                                "microbatches do not divide: give --microbatches dividing the batch")


def run_pipeline_jobs(jobs: Sequence[PipelineJob], nnodes: int = 1, rdzv_endpoint: str | None = None
                      ) -> list[PipelineResult]:
    """Run several jobs (same stages, timeout and threads) one after the other in one launch: the ranks start, import
    torch and meet once (10-15 s here), then run every job. Under torchrun this process runs its rank of each."""
    from .ddp import DDPError, DDPOptions, launch, launched_by_torchrun
    from .pipeline_rank import run_jobs

    jobs = list(jobs)
    first = jobs[0]
    if any((j.stages, j.timeout, j.threads) != (first.stages, first.timeout, first.threads) for j in jobs):
        raise PipelineError("run_pipeline_jobs: the jobs of one launch share their stages, timeout and threads")
    if launched_by_torchrun():
        per_rank = [run_jobs(jobs)]
    else:
        if first.stages % nnodes:
            raise PipelineError(f"pipeline_run: {first.stages} stages do not divide among {nnodes} nodes")
        options = DDPOptions(nproc=first.stages // nnodes, timeout=first.timeout, threads=first.threads,
                             max_restarts=0, rdzv_endpoint=rdzv_endpoint, nnodes=nnodes)
        try:
            per_rank = [r for _, r in sorted(launch(run_jobs, (jobs,), options).items())]
        except DDPError as exc:
            raise PipelineError(f"pipeline_run: {exc}") from None
    return [_result(job, [reports[i] for reports in per_rank]) for i, job in enumerate(jobs)]


def _result(job: PipelineJob, reports: list[RankReport]) -> PipelineResult:
    """One job's result from its ranks' reports (and the outputs file rank 0 wrote, read back)."""
    outputs: dict[str, torch.Tensor] = {}
    if job.output is not None and Path(job.output).is_file() and reports[0].rank == 0:
        from safetensors.torch import load_file

        outputs = load_file(job.output)
    losses = [r.loss for r in reports if r.loss is not None]
    grads = {name: g for r in reports for name, g in r.grads.items()}
    return PipelineResult(ranks=tuple(reports), outputs=outputs, loss=losses[0] if losses else None, grads=grads)


def pipeline_run(checkpoint: str | Path, stages: int, inputs: str | Path | Mapping[str, torch.Tensor],
                 output: str | Path | None = None, *, schedule: str = "gpipe", microbatches: int | None = None,
                 balance: str = "time", timeout: float = 300.0, threads: int | None = None, nnodes: int = 1,
                 rdzv_endpoint: str | None = None, kill_rank: int | None = None, split_embedding: bool = False
                 ) -> PipelineResult:
    """Run the checkpoint's graph on ``inputs`` as ``stages`` pipeline stages, one rank each; rank 0 writes the
    outputs to ``output`` (safetensors, by output name). ``microbatches`` (default: one per stage) must divide
    the batch; ``timeout`` bounds every collective (a frozen rank fails the job after it); ``kill_rank`` makes
    that rank kill itself before the first step (a drill); ``split_embedding`` splits the first stage's largest
    embedding table by rows over all the ranks (each holds 1/N of it; outputs unchanged, bit for bit)."""
    job = pipeline_job(checkpoint, stages, inputs, output, schedule=schedule, microbatches=microbatches,
                       balance=balance, timeout=timeout, threads=threads, kill_rank=kill_rank,
                       split_embedding=split_embedding)
    return run_pipeline_jobs([job], nnodes, rdzv_endpoint)[0]


def pipeline_train_step(checkpoint: str | Path, stages: int, inputs: str | Path | Mapping[str, torch.Tensor],
                        target: str, *, loss: str = "cross_entropy", schedule: str = "gpipe",
                        microbatches: int | None = None, balance: str = "time", timeout: float = 300.0,
                        threads: int | None = None, nnodes: int = 1, rdzv_endpoint: str | None = None
                        ) -> PipelineResult:
    """One training step (forward and backward, no optimizer update) of the checkpoint's graph as ``stages``
    pipeline stages: ``inputs[target]`` is the target of the loss the last stage computes (mean cross entropy over
    the last output dimension, or mean squared error); the result holds the loss and every parameter's gradient,
    which equal a single process's step on the whole batch (dropout off: the graph runs in eval mode)."""
    job = pipeline_job(checkpoint, stages, inputs, schedule=schedule, microbatches=microbatches, balance=balance,
                       timeout=timeout, threads=threads, target=target, loss=loss)
    return run_pipeline_jobs([job], nnodes, rdzv_endpoint)[0]
