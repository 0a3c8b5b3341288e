"""One rank of a pipeline job: load the graph, split it (rank 0 chooses the cuts, every rank applies them), keep
only this rank's stage, and run it under ``torch.distributed.pipelining`` (GPipe or 1F1B over microbatches).

Every rank loads the whole checkpoint, splits it the same way, then drops everything but its own ``stage_k``: what
it holds afterwards (counted over the live parameters of the process) is that stage's parameters alone. Rank 0 feeds
the first stage and writes the outputs the last stage sends it back; in a training step the last stage computes the
loss and every rank reports its own parameters' gradients.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

__all__ = ["ContiguousOutputs", "PipelineJob", "RankReport", "held_parameter_bytes", "rank_main", "run_jobs",
           "split_job", "stage_examples"]

SCHEDULES = ("gpipe", "1f1b")
LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class PipelineJob:
    """What every rank runs (picklable: it travels to spawned processes). ``inputs``: a safetensors path or the
    tensors themselves, by the graph's input names; ``target``: the name of the tensor among them the loss compares
    with (a training step when set); ``kill_rank``: the rank that kills itself before the first step (a drill: the
    job must then fail with a clear error, not hang); ``split_embedding``: the first stage's largest embedding
    table split by rows over every rank (inference; distributed/vocab_stage.py)."""

    checkpoint: str
    stages: int
    inputs: str | dict[str, torch.Tensor]
    output: str | None = None
    schedule: str = "gpipe"
    microbatches: int = 0  # 0: one per stage
    balance: str = "time"
    timeout: float = 300.0
    threads: int | None = None
    target: str | None = None
    loss: str = "cross_entropy"
    kill_rank: int | None = None
    split_embedding: bool = False


@dataclass(frozen=True)
class RankReport:
    """One rank's account: its stage, the cuts, the parameter bytes it holds against the whole graph's, the balance
    shares rank 0 computed, its intra-op threads, and (training) the loss on the last stage and this stage's
    gradients by name."""

    rank: int
    stage: int
    world_size: int
    cuts: tuple[str, ...]
    shares: tuple[float, ...]
    held_param_bytes: int
    total_param_bytes: int
    threads: int = 0
    output_names: tuple[str, ...] = ()
    loss: float | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def held_share(self) -> float:
        """The part of the graph's parameters this rank holds."""
        return self.held_param_bytes / max(1, self.total_param_bytes)


def held_parameter_bytes() -> int:
    """Bytes of every nn.Parameter alive in this process (each storage once): what the rank really holds. A
    tensor-parallel parameter is a DTensor flagged as a parameter (not an nn.Parameter): its local shard counts."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: its instance check touches deprecated objects
        if issubclass(kind, nn.Parameter) or (issubclass(kind, torch.Tensor) and getattr(obj, "_is_param", False)):
            storage = getattr(obj, "_local_tensor", obj).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _Slot:
    """Where the last stage's i-th output goes in the graph's output structure."""

    def __init__(self, index: int) -> None:
        self.index = index


def _output_template(top: fx.GraphModule) -> tuple[Any, Any]:
    """The graph's output structure with the last stage's outputs as slots, and the codegen that rebuilds it."""
    out_node = next(n for n in top.graph.nodes if n.op == "output")
    index = {n: int(n.args[1]) for n in top.graph.nodes
             if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node)
             and str(n.args[0].target).startswith("stage_")}
    template = fx.node.map_arg(out_node.args[0], lambda n: _Slot(index[n]))  # type: ignore[arg-type,return-value]
    return template, top.graph._codegen


def _named_outputs(template: Any, codegen: Any, outs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """The outputs by name: their paths in the graph's output structure (``logits``), or ``output`` for one tensor."""
    flat = fx.node.map_aggregate(template, lambda v: outs[v.index] if isinstance(v, _Slot) else v)
    structured = codegen.process_outputs(flat)
    leaves = pytree.tree_flatten_with_path(structured)[0]
    named: dict[str, torch.Tensor] = {}
    for path, value in leaves:
        if isinstance(value, torch.Tensor):
            name = "".join(c if c.isalnum() or c == "_" else "." for c in pytree.keystr(path)).strip(".")
            named[".".join(p for p in name.split(".") if p) or "output"] = value.detach().contiguous()
    return named


def _loss_fn(kind: str) -> Any:
    """The last stage's loss on (its outputs, the target): the first output against the target, mean-reduced (the
    schedule averages microbatch gradients, so the whole batch's mean loss has the same gradient)."""
    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        out = output[0] if isinstance(output, tuple | list) else output
        if kind == "mse":
            return F.mse_loss(out, target.to(out.dtype))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return loss


def _load_inputs(job: PipelineJob) -> dict[str, torch.Tensor]:
    if isinstance(job.inputs, dict):
        return dict(job.inputs)
    from safetensors.torch import load_file

    return load_file(job.inputs)


def split_job(job: PipelineJob, rank: int, data: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """The checkpoint's graph split into ``job.stages``: rank 0 runs the analysis the balance reads and chooses
    the cuts, the others apply them by name (so every rank cuts alike, whatever the timings)."""
    import torch.distributed as dist

    from ..graph.forge_graph import ForgeGraph
    from ..passes import (
        init_metadata_analysis_pass,
        liveness_analysis_pass,
        profile_analysis_pass,
        split_stages_transform_pass,
    )

    mg = ForgeGraph.from_checkpoint(job.checkpoint).eval()
    mg, _ = init_metadata_analysis_pass(mg)
    shared: list[Any] = [None]
    if rank == 0:
        if job.balance == "time":
            mg, _ = profile_analysis_pass(mg, {"data": data})
        elif job.balance == "memory":
            mg, _ = liveness_analysis_pass(mg, {"data": data})
        split, info = split_stages_transform_pass(mg, {"stages": job.stages, "balance": job.balance, "data": data})
        shared = [(info.cuts, info.shares)]
    dist.broadcast_object_list(shared, src=0)
    cuts, shares = shared[0]
    if rank != 0:
        split, _ = split_stages_transform_pass(mg, {"stages": job.stages, "cuts": cuts, "balance": "params",
                                                    "data": data})
    return split, (tuple(cuts), tuple(shares))


def rank_main(job: PipelineJob) -> RankReport:
    """Run this process's rank of ``job`` (it joins the process group the launcher or torchrun set up)."""
    return run_jobs([job])[0]


def run_jobs(jobs: list[PipelineJob]) -> list[RankReport]:
    """Run this process's rank of each job in turn, in one process group (one launch, one rendezvous)."""
    import torch.distributed as dist

    from .ddp import DDPOptions, init_group

    first = jobs[0]
    rank, world = init_group(DDPOptions(nproc=first.stages, timeout=first.timeout, threads=first.threads))
    reports = [_run_job(job, rank, world) for job in jobs]
    dist.barrier()
    dist.destroy_process_group()
    return reports


class ContiguousOutputs(torch.nn.Module):
    """A stage whose tensor outputs are contiguous: gloo sends only contiguous tensors, and a cut can cross a view."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        out = self.stage(*args)
        if isinstance(out, tuple | list):
            return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


def stage_examples(top: torch.nn.Module, rank: int, flat: list[Any], microbatches: int, train: bool
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """This stage's inputs and outputs on one microbatch, from stages 0..rank run here on the whole split graph.

    PipelineStage is given them instead of inferring shapes itself: its inference runs a stage on torch.empty
    inputs, and an integer tensor crossing a cut (BERT's attention mask at N = 4) then holds garbage indices."""
    values: tuple[Any, ...] = tuple(t[: t.shape[0] // microbatches] if isinstance(t, torch.Tensor) else t
                                    for t in flat)
    ins = values
    with torch.no_grad():
        for k in range(rank + 1):
            ins = values
            out = top.get_submodule(f"stage_{k}")(*values)
            values = tuple(out) if isinstance(out, tuple | list) else (out,)
    def meta(t: torch.Tensor, grad: bool) -> torch.Tensor:  # in a training step activations carry gradients
        return t.contiguous().requires_grad_(grad and t.is_floating_point())

    return (tuple(meta(t, train and rank > 0) for t in ins if isinstance(t, torch.Tensor)),
            tuple(meta(t, train) for t in values))


def _split_table(job: PipelineJob, top: nn.Module, rank: int, world: int, flat: list[Any], microbatches: int,
                 device: torch.device) -> tuple[Any, torch.Tensor, int, Any] | None:
    """With ``job.split_embedding``, the first stage's table split by rows (vocab_stage): this rank's shard, the
    ids it looks up, the microbatches and the lookups' own process group (``send_lookups``' arguments)."""
    if not job.split_embedding or world == 1:
        return None
    from .vocab_stage import split_first_stage

    return split_first_stage(top, rank, world, flat, microbatches, device, job.timeout)


def _run_job(job: PipelineJob, rank: int, world: int) -> RankReport:
    """One job on this rank: split, keep this stage, run the schedule, hand the outputs to rank 0."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ..graph.inputs import ExampleInputs
    from ..passes.propagate import flat_inputs
    from .vocab_stage import send_lookups

    if world != job.stages:
        raise RuntimeError(f"pipeline_run: {job.stages} stages need {job.stages} ranks, the job has {world}")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    shared: list[Any] = [_load_inputs(job) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    data: dict[str, torch.Tensor] = shared[0]
    target = data.pop(job.target) if job.target is not None else None
    split, (cuts, shares) = split_job(job, rank, data)
    total = sum(p.numel() * p.element_size() for p in split.model.parameters())
    flat = flat_inputs(split.model, ExampleInputs.coerce(data))
    template, codegen = _output_template(split.model)
    micro = job.microbatches or world
    train = target is not None
    example_in, example_out = stage_examples(split.model, rank, flat, micro, train)
    lookups = _split_table(job, split.model, rank, world, flat, micro, device)
    stage_module = ContiguousOutputs(split.model.get_submodule(f"stage_{rank}")).to(device)
    # a stage names its layers m0, m1, ...: gradients are reported under the graph's own parameter names
    names_of = {id(p): n for n, p in split.model.named_parameters(remove_duplicate=False) if not n.startswith("stage_")}
    del split  # from here this rank holds its stage only
    held = held_parameter_bytes()
    stage = PipelineStage(stage_module, rank, world, device, input_args=tuple(t.to(device) for t in example_in),
                          output_args=tuple(t.to(device) for t in example_out))
    schedule_cls = ScheduleGPipe if job.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=micro, loss_fn=_loss_fn(job.loss) if train else None)
    if job.kill_rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    losses: list[torch.Tensor] = []
    args = [t.to(device) for t in flat] if rank == 0 else []
    kwargs: dict[str, Any] = {}
    if target is not None and rank == world - 1:
        kwargs = {"target": target.to(device), "losses": losses}
    pending = send_lookups(*lookups) if lookups is not None and rank > 0 else []
    with torch.set_grad_enabled(train):
        out = schedule.step(*args, **kwargs)
    for _, work in pending:
        work.wait()
    names: tuple[str, ...] = ()
    if job.output is not None or not train:
        outs: Any = out if rank == world - 1 else None
        if world > 1 and rank in (0, world - 1):
            box: list[Any] = [outs]
            (dist.send_object_list(box, dst=0, device=device) if rank == world - 1
             else dist.recv_object_list(box, src=world - 1, device=device))
            outs = box[0]
        if rank == 0:
            named = _named_outputs(template, codegen, tuple(outs) if isinstance(outs, tuple | list) else (outs,))
            names = tuple(named)
            if job.output is not None:
                _save(named, Path(job.output))
    grads = {names_of[id(p)]: p.grad.detach().clone() for p in stage_module.parameters() if p.grad is not None}
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    return RankReport(rank=rank, stage=rank, world_size=world, cuts=cuts, shares=shares, held_param_bytes=held,
                      total_param_bytes=total, threads=torch.get_num_threads(), output_names=names, loss=loss,
                      grads=grads)


def _save(named: dict[str, torch.Tensor], path: Path) -> None:
    """Write the outputs as safetensors, atomically (a reader never sees half a file)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({k: v.cpu() for k, v in named.items()}, str(tmp))
    os.replace(tmp, path)
