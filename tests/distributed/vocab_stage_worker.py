"""One rank of the split-embedding pipeline test (torch.multiprocessing spawn): the checkpoint cut into 2 stages,
the first stage's table split by rows over the ranks, GPipe over 4 microbatches; the last rank saves its output."""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import torch


def run_rank(rank: int, world: int, port: int, workdir: str) -> None:
    """Run the split pipeline on ``workdir/io.pt``'s inputs; the last rank writes ``out.pt`` and each rank
    ``held<R>.pt`` (its embedding rows and whether the whole table is gone from its stage)."""
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from fxforge.distributed.pipeline_rank import ContiguousOutputs, PipelineJob, split_job, stage_examples
    from fxforge.distributed.vocab_stage import send_lookups, split_stage_embedding
    from fxforge.graph.inputs import ExampleInputs
    from fxforge.passes.propagate import flat_inputs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        root = Path(workdir)
        data = torch.load(root / "io.pt")["inputs"]
        job = PipelineJob(checkpoint=str(root / "ckpt"), stages=world, inputs=data, balance="time", timeout=60.0,
                          threads=1)
        split, _ = split_job(job, rank, data)
        flat = flat_inputs(split.model, ExampleInputs.coerce(data))
        ins, outs = stage_examples(split.model, rank, flat, 4, train=False)
        group = dist.new_group(backend="gloo")
        shard, index = split_stage_embedding(split.model.get_submodule("stage_0"), rank, world, group)
        stage = PipelineStage(ContiguousOutputs(split.model.get_submodule(f"stage_{rank}")), rank, world,
                              torch.device("cpu"), input_args=ins, output_args=outs)
        schedule = ScheduleGPipe(stage, n_microbatches=4)
        step = functools.partial(schedule.step, *flat) if rank == 0 else schedule.step
        with torch.no_grad():
            for _ in range(2):  # twice: the lookups of every step pair up with that step
                pending = [] if rank == 0 else send_lookups(shard, flat[index], 4, group)
                out = step()
                for _, work in pending:
                    work.wait()
        if rank == world - 1:
            torch.save(out, root / "out.pt")
        torch.save({"rows": (shard.start, shard.stop), "weight": shard.weight.detach()}, root / f"held{rank}.pt")
    finally:
        dist.destroy_process_group()
