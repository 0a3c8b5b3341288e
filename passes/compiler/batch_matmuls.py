"""batch_matmuls_transform_pass: horizontal fusion of matmuls that share a weight or an input.

1. *Sequence batching*: ``matmul(select(X, d, t), W)`` for several ``t`` (the unrolled per-step input
   projections ``x[:, t] @ Vᵀ``) becomes one ``P = matmul(X, W)`` over the whole sequence, split once
   by ``unbind(P, d)``; each step reads its item (one ``unbind`` rather than T ``select``: its backward
   stacks the step gradients once instead of zero-filling a full-size gradient per step).
2. *Sibling batching*: ``matmul(a, W1)``, ``matmul(a, W2)`` … on the same input become one matmul on
   ``cat([W1, W2, …], -1)`` and a slice per original (``V_z`` and ``V_h`` in one GEMM).
3. *Bias absorption*: when every step of ``unbind(P, d)`` is used as ``(u_t + P_t) + b`` with one
   parameter-only vector ``b`` over P's last dim, the split reads ``P + b`` and the per-step bias adds
   go: the bias is added once over the sequence (a re-association: equal within float rounding).
All three apply to ATen graphs (the export frontend, which unrolls loops). Values agree within float
rounding (one GEMM over more rows may sum in another order), gradients too.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .purity import parameter_only_nodes
from .shapes import infer_val, result_dtype, result_shape, strip_identity

aten = torch.ops.aten
_MATMULS = {aten.matmul.default, aten.mm.default}


@dataclass(frozen=True)
class BatchMatmulsInfo(PassInfo):
    """sequence_batched: per-step matmuls replaced by slices of one sequence-wide matmul (groups: how
    many such matmuls); sibling_batched: matmuls merged into one on concatenated weights (groups);
    biases_absorbed: per-step bias adds moved into the sequence-wide projection; nodes_before / nodes_after."""

    sequence_batched: int
    sequence_groups: int
    sibling_batched: int
    sibling_groups: int
    biases_absorbed: int
    nodes_before: int
    nodes_after: int


def _is_matmul(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _MATMULS and not node.kwargs and len(node.args) == 2


def _is_select(node: object) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.select.int
            and isinstance(node.args[1], int) and isinstance(node.args[2], int))


def _last(nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return max(nodes, key=order.__getitem__)


def _batch_sequence(gm: fx.GraphModule, rw: GraphRewrite) -> tuple[int, int]:
    groups: dict[tuple[fx.Node, int, fx.Node], list[tuple[fx.Node, int]]] = defaultdict(list)
    for node in gm.graph.nodes:
        if not _is_matmul(node):
            continue
        sel, weight = strip_identity(node.args[0]), node.args[1]
        if not _is_select(sel) or not isinstance(weight, fx.Node):
            continue
        base = strip_identity(sel.args[0])
        shape, wshape = result_shape(base), result_shape(weight)
        if shape is None or wshape is None or len(wshape) != 2 or len(shape) < 2:
            continue
        dim = sel.args[1] % len(shape)
        if dim == len(shape) - 1:
            continue  # the contraction dim: not a batch dim
        groups[(base, dim, weight)].append((node, sel.args[2]))
    batched = count = 0
    for (base, dim, weight), members in groups.items():
        if len(members) < 2:
            continue
        proj = rw.call_function(aten.matmul.default, (base, weight), before=members[0][0])
        split = rw.call_function(aten.unbind.int, (proj, dim), after=proj)
        infer_val(proj)
        infer_val(split)
        for node, index in members:
            rw.replace(node, "call_function", operator.getitem, (split, index))
            infer_val(node)
        batched += len(members)
        count += 1
    return batched, count


def _batch_siblings(gm: fx.GraphModule, rw: GraphRewrite) -> tuple[int, int]:
    groups: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = defaultdict(list)  # input -> [(matmul, weight)]
    wshapes: dict[fx.Node, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        if not _is_matmul(node):
            continue
        inp, weight = node.args
        if isinstance(inp, fx.Node) and isinstance(weight, fx.Node):
            wshape = result_shape(weight)
            if wshape is not None and len(wshape) == 2 and min(wshape) > 0:
                groups[inp].append((node, weight))
                wshapes[weight] = wshape
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    batched = count = 0
    for inp, members in groups.items():
        weights = list(dict.fromkeys(w for _, w in members))  # distinct, in first-use order
        if len(weights) < 2:
            continue
        shapes = [wshapes[w] for w in weights]
        dtypes = {result_dtype(w) for w in weights}
        if len({s[0] for s in shapes}) != 1 or len(dtypes) != 1:
            continue
        anchor = _last([inp, *weights])
        late_weights = [w for m, w in members if order[m] > order[anchor]]
        if len(set(late_weights)) < len(weights):
            continue  # a member runs before one of the weights exists (hoist first)
        cat = rw.call_function(aten.cat.default, (weights, 1), after=anchor)
        proj = rw.call_function(aten.matmul.default, (inp, cat), after=cat)
        infer_val(cat)
        infer_val(proj)
        offsets: dict[fx.Node, tuple[int, int]] = {}
        start = 0
        for w, s in zip(weights, shapes):
            offsets[w] = (start, start + s[1])
            start += s[1]
        for m, w in members:
            lo, hi = offsets[w]
            rw.replace(m, "call_function", aten.slice.Tensor, (proj, -1, lo, hi))
            infer_val(m)
        batched += len(members)
        count += 1
    return batched, count


def _step_bias(item: fx.Node, constant: set[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """For ``item`` used only as ``(u + item) + b`` (either order inside): (outer add, b)."""
    if len(item.users) != 1:
        return None
    inner = next(iter(item.users))
    if not (_is_add(inner) and len(inner.users) == 1):
        return None
    outer = next(iter(inner.users))
    if not (_is_add(outer) and outer.args[0] is inner):
        return None
    bias = outer.args[1]
    if not (isinstance(bias, fx.Node) and bias in constant):
        return None
    return outer, bias


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target == aten.add.Tensor and len(node.args) == 2
            and not node.kwargs)


def _absorb_biases(gm: fx.GraphModule, rw: GraphRewrite) -> int:
    constant = set(parameter_only_nodes(gm)) | {n for n in gm.graph.nodes if n.op == "get_attr"}
    absorbed = 0
    for split in list(gm.graph.nodes):
        if not (split.op == "call_function" and split.target == aten.unbind.int and split.users):
            continue
        items = list(split.users)
        if not all(i.op == "call_function" and i.target is operator.getitem for i in items):
            continue
        found = [_step_bias(i, constant) for i in items]
        steps = [f for f in found if f is not None]
        biases = {b for _, b in steps}
        if len(steps) != len(found) or len(biases) != 1:
            continue
        proj, dim = split.args[0], split.args[1]
        bias = biases.pop()
        pshape, bshape = result_shape(proj), result_shape(bias)
        if pshape is None or bshape is None or len(bshape) != 1 or bshape[0] != pshape[-1] or pshape[-1] < 0:
            continue
        if dim % len(pshape) == len(pshape) - 1 or result_dtype(bias) != result_dtype(proj):
            continue
        biased = rw.call_function(aten.add.Tensor, (proj, bias), after=_last([proj, bias]))
        infer_val(biased)
        rw.set_arg(split, 0, biased)
        for outer, _ in steps:
            rw.bypass(outer, outer.args[0])
        absorbed += len(steps)
    return absorbed


@forge_pass("transform", NoArgs, info=BatchMatmulsInfo,
            contract=NumericalContract("exact", atol=1e-6, rtol=1e-6,
                                       note="one GEMM over more rows; re-associated bias"))
def batch_matmuls_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, BatchMatmulsInfo]:
    """Batch per-step matmuls over the sequence, merge sibling matmuls, absorb per-step biases."""
    gm = graph.model
    before = len(gm.graph.nodes)
    with GraphRewrite(gm) as rw:
        seq, seq_groups = _batch_sequence(gm, rw)
    with GraphRewrite(gm) as rw:
        sib, sib_groups = _batch_siblings(gm, rw)
    with GraphRewrite(gm) as rw:
        absorbed = _absorb_biases(gm, rw)
    return graph, BatchMatmulsInfo(sequence_batched=seq, sequence_groups=seq_groups, sibling_batched=sib,
                                   sibling_groups=sib_groups, biases_absorbed=absorbed, nodes_before=before,
                                   nodes_after=len(gm.graph.nodes))


