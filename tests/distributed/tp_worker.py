"""One rank of the tensor-parallel test job (started by torch.multiprocessing's spawn): it loads each checkpoint,
splits it with ``tensor_parallel`` over gloo, runs it, and writes what it measured to ``rank<R>.json``."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return _logits(out[0])
    return out.logits  # type: ignore[attr-defined]


def run_rank(rank: int, world: int, port: int, workdir: str, models: list[str]) -> None:
    """Split every model of ``models`` (checkpoints under ``workdir``) over ``world`` ranks and compare its
    outputs with the single-process ones saved in ``workdir/io.pt``; each rank reports its shards' sizes
    and whether they are exactly its slice of the (reordered) global weights."""
    torch.set_num_threads(1)  # spawn does not set OMP_NUM_THREADS: two ranks with every core oversubscribe
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from fxforge import ForgeGraph
    from fxforge.distributed import tensor_parallel

    root = Path(workdir)
    io = torch.load(root / "io.pt")
    report: dict[str, dict[str, object]] = {}
    try:
        for name in models:
            mg = ForgeGraph.from_checkpoint(root / name).eval()
            whole = {k: v.detach().clone() for k, v in mg.model.state_dict().items()}
            mg, info = tensor_parallel(mg)
            with torch.no_grad():
                out = _logits(mg(**io["inputs"][name]))
            exact = True
            vocab = info.plan.vocab.embeddings + info.plan.vocab.heads  # split by rows (torch.chunk's sizes)
            for path in info.plan.colwise + info.plan.rowwise + vocab:
                w = whole[f"{path}.weight"]
                if path in info.plan.row_order:
                    w = w[torch.tensor(info.plan.row_order[path])]
                if path in info.plan.col_order:
                    w = w[:, torch.tensor(info.plan.col_order[path])]
                dim = 1 if path in info.plan.rowwise else 0
                mine = w.chunk(world, dim=dim)[rank]
                exact &= torch.equal(mg.model.get_submodule(path).weight.to_local(), mine)
            report[name] = {"max_abs_diff": float((out - io["reference"][name]).abs().max()),
                            "sharded_global": info.sharded_global, "sharded_local": info.sharded_local,
                            "params_global": info.params_global, "params_local": info.params_local,
                            "shards_exact": exact, "colwise": list(info.plan.colwise),
                            "rowwise": list(info.plan.rowwise), "embeddings": list(info.plan.vocab.embeddings),
                            "heads": list(info.plan.vocab.heads)}
    finally:
        (root / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
