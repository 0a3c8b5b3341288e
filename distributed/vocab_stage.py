"""A pipeline whose first stage's embedding table is split by rows across all the ranks (inference).

Balanced by time, a pipeline puts the embedding lookup (almost free) on the first stage, so that stage holds the
whole table: MiniLM's word embeddings are 52 % of it, and at N = 2 rank 0 held 0.76x of the parameters. Here every
rank keeps a contiguous block of the table's rows (``RowShard``); each rank other than 0 looks up the batch's ids
in its rows (zeros elsewhere) per microbatch and sends the result to rank 0 before its schedule runs, on a
process group of its own (the schedule's sends never mix with these); rank 0's first stage adds them to its own
lookup (``GatheredEmbedding``). Exactly one rank holds each id's row and the others send zeros: the sum is the
table's row, bit for bit. The sends overlap the pipeline's fill: rank r waits for stage 0's first output anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GatheredEmbedding", "RowShard", "VocabStageError", "send_lookups", "split_first_stage",
           "split_stage_embedding"]


class VocabStageError(ValueError):
    """The first stage's embedding cannot be split across the ranks; the message names the layer."""


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` rank ``rank`` of ``world`` keeps (torch.chunk's sizes)."""
    per = -(-rows // world)
    return min(rows, rank * per), min(rows, (rank + 1) * per)


class RowShard(nn.Module):
    """Rows ``[start, stop)`` of an embedding table, looking up the ids among them (zeros for the others)."""

    def __init__(self, table: nn.Embedding, start: int, stop: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(table.weight.detach()[start:stop].clone(), requires_grad=False)
        self.start, self.stop = start, stop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.start) & (ids < self.stop)
        found = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        return found.masked_fill(~inside.unsqueeze(-1), 0.0)


class GatheredEmbedding(RowShard):
    """Rank 0's rows, plus the lookups every other rank sends for the same microbatch (in microbatch order)."""

    def __init__(self, table: nn.Embedding, start: int, stop: int, world: int, group: Any) -> None:
        super().__init__(table, start, stop)
        self.world, self.group = world, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = super().forward(ids)
        part = torch.empty_like(out)
        for src in range(1, self.world):
            dist.recv(part, src=src, group=self.group)
            out = out + part
        return out


def split_stage_embedding(stage: nn.Module, rank: int, world: int, group: Any) -> tuple[RowShard, int]:
    """Split the largest embedding the first pipeline stage ``stage`` (a StageRegion, whole on every rank at this
    point) calls on one of its inputs: on rank 0 the stage's embedding is replaced by a GatheredEmbedding, on the
    others it is left alone (the caller drops that stage). Returns this rank's shard and the stage input index of
    the ids; refuses, naming the layer, an embedding that is not a plain one called on a stage input."""
    children = dict(stage.named_children())
    tables = [(m.weight.numel(), name) for name, m in children.items() if isinstance(m, nn.Embedding)]
    if not tables:
        raise VocabStageError("split embedding: the first stage calls no nn.Embedding")
    name = max(tables)[1]
    table = children[name]
    if type(table) is not nn.Embedding or table.max_norm is not None:
        raise VocabStageError(f"split embedding: layer {name!r} ({type(table).__name__}, max_norm "
                              f"{getattr(table, 'max_norm', None)}) is not a plain embedding: its rows cannot be split")
    graph = getattr(stage, "_graph", None)
    if not isinstance(graph, fx.Graph):
        raise VocabStageError(f"split embedding: the first stage is a {type(stage).__name__}, not a pipeline stage")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == name]
    if len(calls) != 1 or len(calls[0].args) != 1 or calls[0].args[0] not in placeholders:
        raise VocabStageError(f"split embedding: layer {name!r} is not called once on an input of the first stage")
    start, stop = row_range(table.num_embeddings, rank, world)
    if rank == 0:
        shard: RowShard = GatheredEmbedding(table, start, stop, world, group)
        for parent in list(stage.modules()):  # the stage's child, and any parent it reads a buffer from
            for child, module in list(parent.named_children()):
                if module is table:
                    parent.add_module(child, shard)
        getattr(stage, "body")()  # noqa: B009  # rebuilt over the new child now: the graph's owner, the old body, held the whole table
    else:
        shard = RowShard(table, start, stop)
    return shard, placeholders.index(calls[0].args[0])


def send_lookups(shard: RowShard, ids: torch.Tensor, microbatches: int, group: Any) -> list[Any]:
    """Look up each microbatch of ``ids`` in this rank's rows and send it to rank 0 (the schedule's chunks:
    ``tensor_split`` along the batch); returns the pending sends, each with its tensor (wait on them after
    the step)."""
    import torch.distributed as dist

    pending = []
    with torch.no_grad():
        for chunk in ids.tensor_split(microbatches):
            found = shard(chunk).contiguous()
            pending.append((found, dist.isend(found, dst=0, group=group)))
    return pending


def split_first_stage(top: nn.Module, rank: int, world: int, flat: list[Any], microbatches: int,
                      device: torch.device, timeout: float) -> tuple[RowShard, torch.Tensor, int, Any]:
    """Split the first stage (``top.stage_0``) of a split graph's table over every rank on a new process group of
    its own (every rank calls this in the same order; never the schedule's group): ``send_lookups``' arguments."""
    from datetime import timedelta

    import torch.distributed as dist

    group = dist.new_group(timeout=timedelta(seconds=timeout))
    shard, index = split_stage_embedding(top.get_submodule("stage_0"), rank, world, group)
    return shard.to(device), flat[index].to(device), microbatches, group
