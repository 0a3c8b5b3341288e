"""Tensor parallelism of a captured graph with DTensor: the plan is read off the graph, not written by hand.

The pruning pass's dependency groups (passes/prune/groups.py) already say which output rows of which Linear
layers belong together: the q/k/v rows of one attention head (or of one key/value group under GQA), the
rows of one feed-forward unit (a gated MLP's gate and up rows alike), and which input columns of the next
Linear read them. A group never has to leave its rank, so the groups are dealt out to the ranks in order:
the layers producing them are split column-wise (``ColwiseParallel``, whole rows of the weight), the
layers reading them row-wise (``RowwiseParallel``, an all-reduce of the partial products). Between the two,
every rank runs the same graph on its own heads; the literal sizes there (a head count in a view, the
split of a fused q/k/v output) are rewritten for the local shard by the shrink's rewrite, because the
captured graph spells them as numbers. A fused q/k/v layer has its rows reordered first, so that
``ColwiseParallel``'s contiguous shard of rank r holds exactly r's q, k and v rows.

The graph is changed in place (like ``parallelize_module``); its recorded metadata keeps the global shapes.
Keeping DTensors between the layers instead (``use_local_output=False``, no rewrite) fails on every graph tried
(torch 2.13): SDPA's mask and RoPE's tables are plain tensors, and DTensor refuses mixing them.
The large embedding tables and a language model's head are split by rows too (distributed/vocab_parallel.py;
``vocab_parallel="auto"``, the default, keeps a table that cannot be split whole and says why in the plan; ``True``
refuses it naming the layer; ``False`` keeps them all whole).
(``fxforge.distributed.tensor_parallel`` is the function: this module has another name so the two never clash.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph
from ..passes.prune.ffn import ffn_layers
from ..passes.prune.groups import DependencyGraph, GroupError, analyse_dependencies
from ..passes.prune.shrink import resize_literal_sizes
from ..passes.rewrite import GraphRewrite
from .vocab_parallel import VocabLayers, VocabParallelError, vocab_layers

__all__ = ["TPBlock", "TensorParallelError", "TensorParallelInfo", "TensorParallelPlan", "localize_graph",
           "tensor_parallel", "tensor_parallel_plan"]


class TensorParallelError(ValueError):
    """The graph cannot be split over the ranks as asked; the message names the layer and what to do."""


@dataclass(frozen=True)
class TPBlock:
    """One sharded block: an attention (``key`` its SDPA node) or a feed-forward block (``key`` its first
    producer layer), the layers split column-wise and row-wise, and the groups dealt out (heads or units)."""

    kind: str
    key: str
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    groups: int


@dataclass(frozen=True)
class TensorParallelPlan:
    """What ``tensor_parallel`` does on ``world_size`` ranks: the blocks, every column-/row-wise layer, the row
    order of column-wise layers whose groups are not contiguous (a fused q/k/v), the column order of row-wise
    ones, for each rank the bool per dependency unit saying it lives on another rank, and the embeddings and
    heads split by vocabulary rows."""

    world_size: int
    blocks: tuple[TPBlock, ...]
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    row_order: dict[str, tuple[int, ...]]
    col_order: dict[str, tuple[int, ...]]
    elsewhere: torch.Tensor  # [world_size, units + 1] bool (the trailing column: "no unit", never elsewhere)
    dep: DependencyGraph = field(repr=False, compare=False)  # the labels the local sizes are rewritten from
    vocab: VocabLayers = VocabLayers()


@dataclass(frozen=True)
class TensorParallelInfo:
    """The plan applied on this rank, and the weights of its sharded layers: global vs held here (measured
    from the local shards), and every parameter of the graph held here vs the unsharded total."""

    plan: TensorParallelPlan
    rank: int
    sharded_global: int
    sharded_local: int
    params_global: int
    params_local: int

    @property
    def sharded_fraction(self) -> float:
        """Share of the sharded layers' weights this rank holds (1 / world_size when the split is even)."""
        return self.sharded_local / self.sharded_global


def _ordered_roots(dep: DependencyGraph, units: list[int]) -> list[int]:
    """The distinct group roots of ``units``, in the order they first appear."""
    return list(dict.fromkeys(dep.find(u) for u in units))


def _deal(roots: list[int], world: int, shard_of: dict[int, int]) -> set[int]:
    """Give consecutive runs of len(roots) / world groups to each rank; returns the roots dealt."""
    per = len(roots) // world
    for i, root in enumerate(roots):
        shard_of[root] = i // per
    return set(roots)


Found = tuple[str, str, int, set[int]]  # kind, key, number of groups, their roots


def _attention_blocks(dep: DependencyGraph, world: int, shard_of: dict[int, int]) -> list[Found]:
    """One entry per attention; refuses head counts ``world`` does not divide, naming the layers."""
    classes = dep.classes()
    out = []
    for node, per_head in dep.heads.items():
        roots = _ordered_roots(dep, per_head)
        layers = ", ".join(sorted({dep.units[m][0] for r in roots for m in classes[r]}))
        if len(roots) % world:
            what = f"{len(per_head)} heads" + (f" in {len(roots)} key/value groups" if len(roots) != len(per_head)
                                               else "")
            raise TensorParallelError(
                f"tensor_parallel: attention {node!r} (layers {layers}) has {what}, which {world} ranks cannot "
                f"share evenly: use a world size that divides {len(roots)}")
        pinned = next((dep.pinned(r) for r in roots if dep.pinned(r)), None)
        if pinned:
            raise TensorParallelError(f"tensor_parallel: the heads of attention {node!r} (layers {layers}) "
                                      f"cannot be split: {pinned}")
        out.append(("attention", node, len(roots), _deal(roots, world, shard_of)))
    return out


def _ffn_blocks(dep: DependencyGraph, gm: nn.Module, world: int, shard_of: dict[int, int]) -> list[Found]:
    """One entry per feed-forward block; refuses unit counts ``world`` does not divide, naming the layer."""
    modules = dict(gm.named_modules())
    linears = {p: m for p, m in modules.items() if isinstance(m, nn.Linear)}
    blocks = sorted({partners for why, partners in ffn_layers(dep, linears, modules).values() if not why})
    out = []
    for partners in blocks:
        first = partners[0]
        roots = _ordered_roots(dep, [dep.unit_of[(first, r)] for r in range(linears[first].out_features)])
        if len(roots) % world:
            raise TensorParallelError(
                f"tensor_parallel: feed-forward layer {first!r} has {len(roots)} units, which {world} ranks "
                f"cannot share evenly: use a world size that divides {len(roots)}")
        out.append(("ffn", first, len(roots), _deal(roots, world, shard_of)))
    return out


def _order(shards: list[int], what: str, world: int) -> tuple[int, ...]:
    """Indices sorted by shard (stable), after checking every shard gets the same number of them."""
    counts = [shards.count(s) for s in range(world)]
    if -1 in shards or len(set(counts)) != 1:
        raise TensorParallelError(f"tensor_parallel: {what} cannot be split evenly over the ranks (per rank "
                                  f"{counts}, {shards.count(-1)} outside any head or unit)")
    return tuple(sorted(range(len(shards)), key=lambda i: shards[i]))


def _linear(gm: nn.Module, path: str) -> nn.Linear:
    """The plain Linear at ``path``: what ColwiseParallel / RowwiseParallel know how to split."""
    m = gm.get_submodule(path)
    if type(m) is not nn.Linear:
        raise TensorParallelError(f"tensor_parallel: layer {path!r} is a {type(m).__name__}, not a plain Linear: "
                                  "split the graph before LoRA, quantization or pruning masks (shrink first)")
    return m


def _producers(dep: DependencyGraph, roots: set[int]) -> list[str]:
    return list(dict.fromkeys(p for u, (p, _) in enumerate(dep.units) if dep.find(u) in roots))


def _consumers(dep: DependencyGraph, roots: set[int]) -> list[str]:
    return [p for p, cols in dep.columns.items() if any(dep.find(u) in roots for u in cols.values())]


def tensor_parallel_plan(mg: ForgeGraph, world_size: int,
                         vocab_parallel: bool | Literal["auto"] = "auto") -> TensorParallelPlan:
    """The tensor-parallel plan of ``mg`` over ``world_size`` ranks, from its dependency groups alone (no
    process group needed); a head or unit count ``world_size`` does not divide is refused naming the layer. With
    ``vocab_parallel`` the large embeddings and their heads are split by rows too (an unsplittable table kept
    whole with ``"auto"``, refused with ``True``)."""
    if type(world_size) is not int or world_size < 1:
        raise TensorParallelError(f"tensor_parallel: world_size must be an integer >= 1, got {world_size!r}")
    if vocab_parallel not in (True, False, "auto") or type(vocab_parallel) not in (bool, str):
        raise TensorParallelError(f"tensor_parallel: vocab_parallel must be True, False or 'auto', "
                                  f"got {vocab_parallel!r}")
    try:
        dep = analyse_dependencies(mg.model, mg.example_inputs)
    except GroupError as exc:
        raise TensorParallelError(f"tensor_parallel: {exc}") from exc
    shard_of: dict[int, int] = {}
    found = _attention_blocks(dep, world_size, shard_of) + _ffn_blocks(dep, mg.model, world_size, shard_of)
    blocks, rows, cols = [], {}, {}
    for kind, key, groups, roots in found:
        producers, consumers = _producers(dep, roots), _consumers(dep, roots)
        for path in producers:
            n = _linear(mg.model, path).out_features
            rows[path] = _order([shard_of.get(dep.root(path, r), -1) for r in range(n)], f"the rows of {path!r}",
                                world_size)
        for path in consumers:
            n, mine = _linear(mg.model, path).in_features, dep.columns[path]
            cols[path] = _order([shard_of.get(dep.find(mine[c]), -1) if c in mine else -1 for c in range(n)],
                                f"the input columns of {path!r}", world_size)
        blocks.append(TPBlock(kind, key, tuple(producers), tuple(consumers), groups))
    both = sorted(set(rows) & set(cols))
    if both:
        raise TensorParallelError(f"tensor_parallel: layer {both[0]!r} both reads and produces sharded heads / "
                                  "units: it cannot be split column-wise and row-wise at once")
    elsewhere = torch.zeros(world_size, len(dep.units) + 1, dtype=torch.bool)
    for u in range(len(dep.units)):
        s = shard_of.get(dep.find(u), -1)
        if s >= 0:
            elsewhere[:, u] = True
            elsewhere[s, u] = False
    moved = {p: o for p, o in rows.items() if o != tuple(range(len(o)))}
    try:
        vocab = (vocab_layers(mg.model, world_size, set(rows) | set(cols), strict=vocab_parallel is True)
                 if vocab_parallel else VocabLayers())
    except VocabParallelError as exc:
        raise TensorParallelError(str(exc)) from None
    return TensorParallelPlan(world_size, tuple(blocks), tuple(rows), tuple(cols), moved,
                              {p: o for p, o in cols.items() if o != tuple(range(len(o)))}, elsewhere, dep, vocab)


def _local(p: torch.Tensor) -> int:
    """Elements of ``p`` held by this rank (a DTensor's local shard)."""
    to_local = getattr(p, "to_local", None)
    return int(to_local().numel()) if callable(to_local) else int(p.numel())


def _weight(gm: nn.Module, path: str) -> torch.Tensor:
    """The weight of the split layer at ``path`` (a Linear's or an Embedding's; a DTensor once split)."""
    weight = gm.get_submodule(path).weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _reorder(gm: nn.Module, plan: TensorParallelPlan) -> None:
    """Permute rows / columns so each rank's contiguous shard holds its own groups (a fused q/k/v layer)."""
    with torch.no_grad():
        for path, order in plan.row_order.items():
            m, idx = _linear(gm, path), torch.tensor(order)
            m.weight.copy_(m.weight[idx])
            if m.bias is not None:
                m.bias.copy_(m.bias[idx])
        for path, order in plan.col_order.items():
            m = _linear(gm, path)
            m.weight.copy_(m.weight[:, torch.tensor(order)])


def localize_graph(mg: ForgeGraph, plan: TensorParallelPlan, rank: int) -> ForgeGraph:
    """Prepare ``mg`` (in place) for ``rank``'s shard: rows / columns reordered so contiguous shards hold whole
    groups, and the literal sizes between the column- and row-wise layers (head counts, split sizes) those
    of one rank. The weights stay whole: ``parallelize_module`` cuts them. Metadata keeps the global shapes."""
    if not 0 <= rank < plan.world_size:
        raise TensorParallelError(f"tensor_parallel: rank {rank} is outside the plan's {plan.world_size} ranks")
    _reorder(mg.model, plan)
    try:
        resize_literal_sizes(GraphRewrite(mg.model), plan.dep, plan.elsewhere[rank])
    except GroupError as exc:
        raise TensorParallelError(f"tensor_parallel: {exc}") from exc
    mg.model.graph.lint()
    mg.recompile()
    return mg


def tensor_parallel(mg: ForgeGraph, mesh: Any = None, plan: TensorParallelPlan | None = None,
                    vocab_parallel: bool | Literal["auto"] = "auto") -> tuple[ForgeGraph, TensorParallelInfo]:
    """Split ``mg`` over the ranks of the 1-D DeviceMesh ``mesh`` (default: every rank of the initialised
    process group, on CUDA when present) with ``parallelize_module``; every rank must call it on the same
    graph. Returns the graph (changed in place) and what this rank holds. ``vocab_parallel``: see the plan."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh is None:
        if not dist.is_initialized():
            raise TensorParallelError("tensor_parallel: no process group: call torch.distributed.init_process_group "
                                      "first (torchrun, or fxforge.distributed's launcher), or pass a DeviceMesh")
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    if mesh.ndim != 1:
        raise TensorParallelError(f"tensor_parallel: the mesh must be 1-D (slice a {mesh.ndim}-D mesh first, "
                                  "e.g. mesh['tp'])")
    world, rank = mesh.size(), mesh.get_local_rank()
    plan = plan or tensor_parallel_plan(mg, world, vocab_parallel)
    if plan.world_size != world:
        raise TensorParallelError(f"tensor_parallel: the plan is for {plan.world_size} ranks, the mesh has {world}")
    gm = mg.model
    params_global = sum(p.numel() for p in gm.parameters())
    split = plan.colwise + plan.rowwise + plan.vocab.embeddings + plan.vocab.heads
    sharded_global = sum(_weight(gm, p).numel() for p in split)
    localize_graph(mg, plan, rank)
    styles: dict[str, Any] = {p: ColwiseParallel() for p in plan.colwise}
    styles.update({p: RowwiseParallel() for p in plan.rowwise})
    styles.update({p: RowwiseParallel(input_layouts=Replicate()) for p in plan.vocab.embeddings})  # ids whole
    styles.update({p: ColwiseParallel(output_layouts=Replicate()) for p in plan.vocab.heads})  # logits gathered
    parallelize_module(gm, mesh, styles)
    sharded = [_weight(gm, p) for p in split]
    info = TensorParallelInfo(plan, rank, sharded_global, sum(_local(w) for w in sharded), params_global,
                              sum(_local(p) for p in gm.parameters()))
    return mg, info
