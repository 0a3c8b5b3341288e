"""fuse_elementwise_transform_pass: small elementwise chains become one fused ATen op.

``x + (a * s) * b`` and ``x + a * b`` (s a Python scalar; the A-GRU update ``h + ε·z·c``) become
``addcmul(x, a, b, value=s)``: one kernel and one autograd node instead of three. ATen evaluates
``x + (s·a)·b`` in the same order but its vectorised kernel may fuse the multiply-add, so values
agree within one rounding (~1e-7 relative), not bit for bit. Larger gate fusions (sigmoid/tanh
with their adds) are left to ``torch.compile`` on the optimized graph: benchmarks/bench_agru.py
measures both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from .shapes import infer_val, result_dtype, result_shape

aten = torch.ops.aten


@dataclass(frozen=True)
class FuseElementwiseInfo(PassInfo):
    """addcmul: add/mul/mul chains fused into addcmul; nodes_before / nodes_after: graph size."""

    addcmul: int
    nodes_before: int
    nodes_after: int


def _binary(node: object, target: object) -> TypeGuard[fx.Node]:
    """Whether ``node`` is a node calling ``target`` on two positional arguments (and no keywords)."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target == target
            and len(node.args) == 2 and not node.kwargs)


def _split_scaled(node: fx.Node) -> tuple[fx.Node, float | int] | None:
    """``a * s`` with a scalar s (either order) -> (a, s)."""
    a, b = node.args
    if isinstance(a, fx.Node) and isinstance(b, int | float) and not isinstance(b, bool):
        return a, b
    if isinstance(b, fx.Node) and isinstance(a, int | float) and not isinstance(a, bool):
        return b, a
    return None


def _match(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, float | int, list[fx.Node]] | None:
    """(x, a, b, value, fused nodes) for ``x + (a*s)*b`` / ``x + a*b``."""
    for x, prod in (add.args, add.args[::-1]):
        if not (isinstance(x, fx.Node) and _binary(prod, aten.mul.Tensor) and len(prod.users) == 1):
            continue
        left, right = prod.args
        if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)):
            continue
        for scaled, other in ((left, right), (right, left)):
            if _binary(scaled, aten.mul.Tensor) and len(scaled.users) == 1:
                split = _split_scaled(scaled)
                if split is not None:
                    return x, split[0], other, split[1], [scaled, prod]
        return x, left, right, 1, [prod]
    return None


def _fuse_addcmul(gm: fx.GraphModule, rw: GraphRewrite) -> int:
    fused = 0
    for add in list(gm.graph.nodes):
        if not _binary(add, aten.add.Tensor):
            continue
        found = _match(add)
        if found is None:
            continue
        x, a, b, value, inner = found
        shapes = [result_shape(n) for n in (x, a, b, add)]
        if any(s is None for s in shapes) or shapes[0] != shapes[3]:
            continue  # addcmul's result takes x's shape only when x is not broadcast
        if len({result_dtype(n) for n in (x, a, b)}) != 1:
            continue
        kwargs = {} if value == 1 else {"value": value}
        rw.replace(add, "call_function", aten.addcmul.default, (x, a, b), kwargs)
        infer_val(add)
        for node in reversed(inner):
            if not node.users:
                rw.bypass(node, None)
        fused += 1
    return fused


@forge_pass("transform", NoArgs, info=FuseElementwiseInfo,
            contract=NumericalContract("exact", atol=1e-6, rtol=1e-6, note="x + (s*a)*b, maybe one fused rounding"))
def fuse_elementwise_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, FuseElementwiseInfo]:
    """Fuse ``x + (a*s)*b`` chains into ``addcmul`` (ATen graphs)."""
    gm = graph.model
    before = len(gm.graph.nodes)
    with GraphRewrite(gm) as rw:
        fused = _fuse_addcmul(gm, rw)
    return graph, FuseElementwiseInfo(addcmul=fused, nodes_before=before, nodes_after=len(gm.graph.nodes))
