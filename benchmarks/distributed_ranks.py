"""One rank of bench_distributed: build this rank's share of each model, then time pipeline steps and read memory.

N = 1 runs the unsplit graph in one process (the baseline); N > 1 cuts the checkpoint's graph into N stages the
way ``pipeline_run`` does (distributed/pipeline_rank: rank 0 chooses time-balanced cuts, every rank keeps only its
stage) and runs ``torch.distributed.pipelining``'s GPipe / 1F1B schedules over microbatches, and (schedule "tp")
splits it with ``tensor_parallel`` (heads, FFN units, the large embeddings and a vocabulary head over the ranks),
every rank running the whole batch. A step is timed between
two barriers (every rank done), so the time is the pipeline's, not one rank's. Memory: the parameter bytes a rank
holds (every live nn.Parameter), and the peak resident set (CPU: the kernel's high-water mark, reset through
/proc/self/clear_refs) or the CUDA allocator's peak (GPU), while loading and while stepping.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BenchModel", "RankMeasure", "RankSpec", "held_key", "rank_entry"]


@dataclass(frozen=True)
class BenchModel:
    """A model to run: its checkpoint directory and the batch (by the graph's input names) one step runs on."""

    name: str
    checkpoint: str
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one launch runs (picklable: it travels to the spawned ranks)."""

    models: tuple[BenchModel, ...]
    schedules: tuple[str, ...]
    microbatches: int
    repeats: int
    warmup: int
    threads: int
    timeout: float
    balance: str = "time"
    split_embedding: bool = False  # the pipeline's first-stage table split by rows over the ranks (vocab_stage)


@dataclass(frozen=True)
class RankMeasure:
    """One rank's numbers. ``times``: seconds per step by variant (``model/schedule``; at N=1 ``model/forward``,
    the whole batch at once, and ``model/microbatched``, the pipeline's microbatches one after the other),
    interleaved rounds in run order; ``held`` / ``total``: parameter bytes this rank holds / the whole graph has;
    ``load_peak`` (by model) and ``run_peak`` (by variant): peak memory bytes, of ``peak_kind``. A tensor-parallel
    build's ``held`` / ``load_peak`` are keyed ``model/tp`` (``held_key``)."""

    rank: int
    world: int
    threads: int
    device: str
    peak_kind: str
    times: dict[str, list[float]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    load_peak: dict[str, int] = field(default_factory=dict)
    run_peak: dict[str, int] = field(default_factory=dict)
    cuts: dict[str, list[str]] = field(default_factory=dict)


def held_key(model: str, schedule: str) -> str:
    """The key of a variant's ``held`` / ``load_peak``: the model's (its pipeline stage, or the whole graph at
    N = 1), or ``model/tp`` for the tensor-parallel build."""
    return f"{model}/tp" if schedule == "tp" else model


def _reset_peak(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's, or the kernel's resident high-water mark (clear_refs 5)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # hand freed heap back first: the resident set then drops to what is live (glibc keeps it otherwise)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # no procfs: ru_maxrss below is then the process's peak so far
        pass


def _peak(device: torch.device) -> int:
    """Bytes at the peak since the last reset."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _timed(step: Callable[[], Any], device: torch.device) -> Callable[[], float]:
    """``step`` between two barriers (all ranks start together and have all finished): its seconds."""
    import torch.distributed as dist

    def run() -> float:
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter() - start
    return run


def _build_tp(model: BenchModel, device: torch.device, out: RankMeasure) -> Callable[[], Any]:
    """This rank's tensor-parallel share of ``model`` and its step (the whole batch); records held bytes and the
    load peak under ``model/tp``."""
    from fxforge.distributed.pipeline_rank import held_parameter_bytes
    from fxforge.distributed.tensor_parallelism import tensor_parallel
    from fxforge.graph.forge_graph import ForgeGraph
    from fxforge.graph.inputs import ExampleInputs
    from fxforge.passes.propagate import flat_inputs

    before = held_parameter_bytes()
    _reset_peak(device)
    mg = ForgeGraph.from_checkpoint(model.checkpoint).eval()
    mg.model.to(device)
    mg, _ = tensor_parallel(mg)
    graph = mg.model
    flat = [t.to(device) for t in flat_inputs(graph, ExampleInputs.coerce(dict(model.inputs)))]
    key = held_key(model.name, "tp")
    out.held[key] = held_parameter_bytes() - before
    out.load_peak[key] = _peak(device)
    return functools.partial(graph, *flat)


def _step_sending(step: Callable[[], Any], lookups: tuple[Any, torch.Tensor, int, Any]) -> None:
    """A rank > 0's pipeline step when the first stage's table is split: its lookups sent to rank 0 first."""
    from fxforge.distributed.vocab_stage import send_lookups

    pending = send_lookups(*lookups)
    step()
    for _, work in pending:
        work.wait()


def _build(model: BenchModel, spec: RankSpec, rank: int, world: int, device: torch.device,
           out: RankMeasure) -> dict[str, Callable[[], Any]]:
    """This rank's share of ``model`` and one step function per variant; records held bytes and the load peak."""
    from fxforge.distributed.pipeline_rank import (
        ContiguousOutputs,
        PipelineJob,
        held_parameter_bytes,
        split_job,
        stage_examples,
    )
    from fxforge.graph.forge_graph import ForgeGraph
    from fxforge.graph.inputs import ExampleInputs
    from fxforge.passes.propagate import flat_inputs

    before = held_parameter_bytes()
    _reset_peak(device)
    data = dict(model.inputs)
    if world == 1:
        graph = ForgeGraph.from_checkpoint(model.checkpoint).eval().model.to(device)
        flat = [t.to(device) for t in flat_inputs(graph, ExampleInputs.coerce(data))]
        out.total[model.name] = sum(p.numel() * p.element_size() for p in graph.parameters())
        chunks = list(zip(*(t.tensor_split(spec.microbatches) if isinstance(t, torch.Tensor)
                            else [t] * spec.microbatches for t in flat), strict=True))
        steps: dict[str, Callable[[], Any]] = {f"{model.name}/forward": lambda: graph(*flat),
                                               f"{model.name}/microbatched": lambda: [graph(*c) for c in chunks]}
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        job = PipelineJob(checkpoint=model.checkpoint, stages=world, inputs=data, balance=spec.balance,
                          timeout=spec.timeout, threads=spec.threads)
        split, (cuts, _) = split_job(job, rank, data)
        out.cuts[model.name] = list(cuts)
        out.total[model.name] = sum(p.numel() * p.element_size() for p in split.model.parameters())
        flat = [t.to(device) for t in flat_inputs(split.model, ExampleInputs.coerce(data))]
        ins, outs = stage_examples(split.model, rank, flat, spec.microbatches, train=False)
        lookups: Any = None
        if spec.split_embedding:
            from fxforge.distributed.vocab_stage import split_first_stage

            lookups = split_first_stage(split.model, rank, world, flat, spec.microbatches, device, spec.timeout)
        module = ContiguousOutputs(split.model.get_submodule(f"stage_{rank}").to(device))
        del split  # from here this rank holds its stage only (and its rows of a split table)
        args = flat if rank == 0 else []
        steps = {}
        for name in spec.schedules:
            if name == "tp":
                continue
            cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
            stage = PipelineStage(module, rank, world, device, input_args=ins, output_args=outs)
            schedule = cls(stage, n_microbatches=spec.microbatches)
            steps[f"{model.name}/{name}"] = functools.partial(schedule.step, *args)
            if lookups is not None and rank > 0:
                steps[f"{model.name}/{name}"] = functools.partial(_step_sending, schedule.step, lookups)
    out.held[model.name] = held_parameter_bytes() - before
    out.load_peak[model.name] = _peak(device)
    if world > 1 and "tp" in spec.schedules:
        steps[f"{model.name}/tp"] = _build_tp(model, device, out)
    return steps


def rank_entry(spec: RankSpec) -> RankMeasure:
    """Run this rank of the launch: build every model, read each variant's running peak, then time them all in
    interleaved rounds (every rank runs the same variants in the same order)."""
    import torch.distributed as dist

    from fxforge.benchmarks.timing import interleaved
    from fxforge.distributed.ddp import DDPOptions, init_group

    rank, world = init_group(DDPOptions(nproc=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), timeout=spec.timeout,
                                        threads=spec.threads))
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    out = RankMeasure(rank=rank, world=world, threads=torch.get_num_threads(), device=str(device),
                      peak_kind="CUDA allocator peak" if device.type == "cuda" else "peak RSS")
    variants: dict[str, Callable[[], float]] = {}
    for model in spec.models:
        for name, step in _build(model, spec, rank, world, device, out).items():
            timed = _timed(step, device)
            _reset_peak(device)
            timed()  # the first step also sets up the stages' buffers: part of running, not of loading
            timed()
            out.run_peak[name] = _peak(device)
            variants[name] = timed
    timings = interleaved(variants, spec.repeats, warmup=spec.warmup)
    out.times.update(timings.times)
    dist.barrier()
    dist.destroy_process_group()
    return out
