"""``shrink_transform_pass``: physically remove the pruned units -- smaller dense Linear layers.

The dependency groups (passes/prune/groups.py) say which rows and columns must go together. A group is
removed when every producer row in it is fully masked (weights and bias) by ``prune_transform_pass``:
the q/k/v rows of a head and the output projection's columns, an FFN unit's row and the next layer's
column. Then producer rows and consumer columns are sliced out and the graph's literal sizes (head
count in view / reshape, split sizes) follow. A masked model's outputs are unchanged (exact contract).
A masked row the analysis cannot remove on its own (tied to unmasked rows, or pinned by the residual
stream / a LayerNorm / the output) is an error naming the node, never a silently wrong shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .groups import DependencyGraph, GroupError, analyse_dependencies
from .modules import PrunedLinear, is_masked, layer_weight

__all__ = ["shrink_transform_pass", "ShrinkArgs", "ShrinkInfo", "resize_literal_sizes"]

_SIZE_OPS = frozenset({"view", "reshape", "expand"})
_L = TypeVar("_L", bound=nn.Linear)


@dataclass(frozen=True)
class ShrinkArgs:
    """strict: a fully masked row that cannot be removed is an error (False: it stays, listed in info)."""

    strict: bool = True


@dataclass(frozen=True)
class ShrinkInfo(PassInfo):
    """Layers resized (path -> (out, in) before and after), heads kept per attention, params before/after."""

    resized: dict[str, tuple[tuple[int, int], tuple[int, int]]]
    heads: dict[str, tuple[int, int]]
    groups_removed: int
    params_before: int
    params_after: int
    kept_masked: tuple[str, ...]


def _row_masked(m: nn.Module, r: int) -> bool:
    if not is_masked(m):
        return False
    bias_off = m.bias is None or not bool(m.existing_bias_mask()[r])
    return bias_off and not bool(m.weight_mask[r].any())


def _removable(dep: DependencyGraph, gm: fx.GraphModule, strict: bool) -> tuple[set[int], list[str]]:
    removed: set[int] = set()
    kept_masked: list[str] = []
    modules = dict(gm.named_modules())
    for root, members in dep.classes().items():
        rows = [dep.units[u] for u in members]
        masked = [_row_masked(modules[p], r) for p, r in rows]
        if not any(masked):
            continue
        if all(masked) and not dep.pinned(root):
            removed.add(root)
            continue
        p, r = next(pr for pr, m in zip(rows, masked) if m)
        why = dep.pinned(root) or "it is tied to rows that are not masked: " + ", ".join(
            f"{q}[{s}]" for (q, s), m in zip(rows, masked) if not m)
        if strict:
            raise GroupError(f"cannot remove row {r} of {p!r}: {why} (strict=False keeps it masked)")
        kept_masked.append(f"{p}[{r}]")
    return removed, kept_masked


def _kept_per_axis(lab: torch.Tensor, gone: torch.Tensor, name: str) -> list[int]:
    removed = gone[lab.clamp(min=0)] & (lab >= 0)
    kept = []
    for d in range(lab.dim()):
        flat = removed.movedim(d, 0).reshape(lab.shape[d], -1)
        kept.append(int((~flat.all(dim=1)).sum()))
    total = 1
    for k in kept:
        total *= k
    if removed.numel() and total != int((~removed).sum()):
        raise GroupError(f"shrink: node {name!r} would not stay rectangular after removing the pruned units")
    return kept


def _resize_args(rw: GraphRewrite, node: fx.Node, old: list[int], new: list[int]) -> None:
    if old == new:
        return
    args = list(node.args)
    if len(args) == 2 and isinstance(args[1], list | tuple):
        shape, packed = list(args[1]), True
    else:
        shape, packed = args[1:], False
    if len(shape) != len(old):
        raise GroupError(f"shrink: cannot read the sizes of node {node.name!r}")
    for i, (o, n) in enumerate(zip(old, new)):
        if o != n:
            if isinstance(shape[i], int) and shape[i] == o:
                shape[i] = n
            elif not (isinstance(shape[i], int) and shape[i] == -1) and not isinstance(shape[i], fx.Node):
                raise GroupError(f"shrink: node {node.name!r} has a size {shape[i]!r} the shrink cannot update")
    rw.set_args(node, (args[0], shape) if packed else (args[0], *shape))


def _resize_split(rw: GraphRewrite, node: fx.Node, chunks: tuple[torch.Tensor, ...], gone: torch.Tensor) -> None:
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    if not isinstance(dim, int):
        raise GroupError(f"shrink: split node {node.name!r} has a dim {dim!r} the shrink cannot read")
    sizes = [_kept_per_axis(c, gone, node.name)[dim] for c in chunks]
    if sizes == [c.shape[dim] for c in chunks]:
        return
    if not isinstance(node.args[1], int) or len(set(sizes)) != 1:
        raise GroupError(f"shrink: split node {node.name!r} would need unequal chunk sizes {sizes}")
    if str(getattr(node.target, "__name__", node.target)).split(".")[0] != "chunk":  # chunk's is a count: it stays
        rw.set_args(node, (node.args[0], sizes[0], *node.args[2:]))


def resize_literal_sizes(rw: GraphRewrite, dep: DependencyGraph, gone: torch.Tensor) -> None:
    """Rewrite the literal sizes (view / reshape / expand sizes, split sizes) of ``rw``'s graph for the units
    ``gone`` marks (a bool per unit id, plus a trailing False) taken out of every tensor they label; also
    used by tensor parallelism, where the units of the other ranks' shards are the ones gone."""
    for node in list(rw.graph.nodes):
        lab = dep.labels.get(node.name)
        if lab is None or node.op not in ("call_function", "call_method"):
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if isinstance(lab, torch.Tensor):
            kept = _kept_per_axis(lab, gone, node.name)
            if name in _SIZE_OPS:
                _resize_args(rw, node, list(lab.shape), kept)
        elif name in ("split", "chunk") and all(isinstance(c, torch.Tensor) for c in lab):
            _resize_split(rw, node, tuple(lab), gone)


def _sliced(m: nn.Module, rows: torch.Tensor, cols: torch.Tensor) -> nn.Module:
    if not isinstance(m, nn.Linear) or type(m) not in (nn.Linear, PrunedLinear):
        raise GroupError(f"shrink: layer of type {type(m).__name__} cannot be resized (shrink before LoRA / "
                         "quantization)")
    w = m.weight.detach()[rows][:, cols]
    bias = m.bias
    b = None if bias is None else bias.detach()[rows]
    size = (int(cols.numel()), int(rows.numel()), b is not None)
    new: nn.Linear
    with torch.no_grad():
        if is_masked(m) and not bool(m.weight_mask[rows][:, cols].all()):  # masked entries stay: keep the masks
            pruned = _empty(PrunedLinear, *size, like=w)
            pruned.weight_mask = m.weight_mask[rows][:, cols].clone()
            pruned.bias_mask = None if b is None else m.existing_bias_mask()[rows].clone()
            pruned.act_sparsity, pruned.act_method, pruned.act_scope = m.act_sparsity, m.act_method, m.act_scope
            new = pruned
        else:
            new = _empty(nn.Linear, *size, like=w)
        new.weight = nn.Parameter(w.clone(), requires_grad=m.weight.requires_grad)
        if bias is not None and b is not None:
            new.bias = nn.Parameter(b.clone(), requires_grad=bias.requires_grad)
    return new.train(m.training)


def _empty(cls: type[_L], in_features: int, out_features: int, bias: bool, like: torch.Tensor) -> _L:
    """An uninitialised ``cls`` layer on ``like``'s device and dtype (built on meta: no random init)."""
    with torch.device("meta"):
        layer = cls(in_features, out_features, bias=bias)
    return layer.to_empty(device=like.device).to(like.dtype)


@forge_pass("transform", ShrinkArgs, info=ShrinkInfo, requires=("pruned",),
            forbids=("quantized", "lora", "int8-lowered"),
            contract=NumericalContract("exact", atol=1e-5, note="only fully masked units are removed"))
def shrink_transform_pass(graph: ForgeGraph, args: ShrinkArgs) -> tuple[ForgeGraph, ShrinkInfo]:
    """Remove every fully masked dependency group: smaller dense layers, updated head split."""
    gm = graph.model
    before = sum(p.numel() for p in gm.parameters())
    dep = analyse_dependencies(gm, graph.example_inputs)
    removed, kept_masked = _removable(dep, gm, args.strict)
    table = torch.tensor([dep.find(u) in removed for u in range(len(dep.units))] + [False])
    heads = {node: (len(per), sum(1 for u in per if dep.find(u) not in removed)) for node, per in dep.heads.items()}
    rw = GraphRewrite(gm)
    resize_literal_sizes(rw, dep, table)  # literal sizes first (labels are those of the unshrunk graph)
    resized: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
    paths = {p for p, _ in dep.units} | set(dep.columns)
    for path in sorted(paths):
        m = gm.get_submodule(path)
        out_f, in_f = layer_weight(m).shape[0], layer_weight(m).shape[1]
        rows = torch.tensor([r for r in range(out_f) if (path, r) not in dep.unit_of
                             or dep.find(dep.unit_of[(path, r)]) not in removed], dtype=torch.long)
        cols_map = dep.columns.get(path, {})
        cols = torch.tensor([c for c in range(in_f) if c not in cols_map or dep.find(cols_map[c]) not in removed],
                            dtype=torch.long)
        if rows.numel() == out_f and cols.numel() == in_f:
            continue
        rw.set_module(path, _sliced(m, rows, cols))
        resized[path] = ((out_f, in_f), (int(rows.numel()), int(cols.numel())))
    rw.touch(*[n for n in gm.graph.nodes if n.op != "placeholder"])  # sizes change downstream; inputs keep theirs
    rw.finish()  # metadata re-derived once, after every resize
    after = sum(p.numel() for p in gm.parameters())
    return graph, ShrinkInfo(resized, heads, len(removed), before, after, tuple(kept_masked))
