"""afno_real_arithmetic_transform_pass: complex multiplies between the FFTs become real tensor ops.

Inductor does not generate code for complex tensors, so ``torch.compile`` of the AFNO mixer falls back
to eager for ``rfft(x) * rfft(k)`` and fuses nothing around it. This pass rewrites every complex x complex
``mul`` node into real arithmetic on the stacked (real, imag) parts::

    ra, rb = view_as_real(a), view_as_real(b)
    out = view_as_complex(stack([ar*br - ai*bi, ar*bi + ai*br], -1))

so the only complex *computations* left are the FFTs (``view_as_real`` / ``view_as_complex`` are free
views). Contract: outputs within 1e-5 and gradients unchanged (same arithmetic, reassociated).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.metadata import get_meta, has_meta
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite

# Ops with complex results that compute nothing (views, layout) or are the FFTs themselves.
COMPLEX_VIEWS: frozenset[str] = frozenset({
    "view_as_complex", "view_as_real", "reshape", "view", "transpose", "permute", "contiguous", "narrow",
    "slice", "getitem", "unsqueeze", "squeeze", "expand", "clone", "alias", "_unsafe_view", "placeholder",
    "get_attr", "output",
})


def is_complex(node: object) -> bool:
    """Whether a node's recorded result is a complex tensor."""
    if not isinstance(node, fx.Node) or not has_meta(node):
        return False
    value = get_meta(node).common.results.get("data_out_0")
    return value is not None and (value.dtype or "").startswith("complex")


def complex_compute_ops(gm: fx.GraphModule) -> list[str]:
    """Canonical ops of the nodes that compute on complex values (FFTs included), in graph order."""
    return [classify(n, gm)[1] for n in gm.graph.nodes
            if is_complex(n) and classify(n, gm)[1] not in COMPLEX_VIEWS]


@dataclass(frozen=True)
class AfnoRealInfo(PassInfo):
    """rewritten: complex multiplies turned real; complex_ops_before / after: what still computes on complex."""

    rewritten: int = 0
    complex_ops_before: tuple[str, ...] = ()
    complex_ops_after: tuple[str, ...] = ()


def _real_mul(rw: GraphRewrite, node: fx.Node) -> fx.Node:
    a, b = node.args

    def call(fn: object, *args: object) -> fx.Node:
        return rw.call_function(fn, tuple(args), before=node)  # type: ignore[arg-type]

    ra, rb = call(torch.view_as_real, a), call(torch.view_as_real, b)
    ar, ai = call(torch.select, ra, -1, 0), call(torch.select, ra, -1, 1)
    br, bi = call(torch.select, rb, -1, 0), call(torch.select, rb, -1, 1)
    re = call(operator.sub, call(operator.mul, ar, br), call(operator.mul, ai, bi))
    im = call(operator.add, call(operator.mul, ar, bi), call(operator.mul, ai, br))
    return call(torch.view_as_complex, call(torch.stack, [re, im], -1))


@forge_pass("transform", NoArgs, info=AfnoRealInfo, requires=("shapes",),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5, note="outputs and gradients"))
def afno_real_arithmetic_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, AfnoRealInfo]:
    """Rewrite complex x complex multiplies (AFNO's FFT-domain products) into real ops on (real, imag) pairs."""
    gm = graph.model
    before = tuple(complex_compute_ops(gm))
    rewritten = 0
    for node in list(gm.graph.nodes):
        if classify(node, gm)[1] != "mul" or node.kwargs or len(node.args) != 2 \
                or not all(is_complex(a) for a in node.args):
            continue
        with GraphRewrite(gm) as rw:
            rw.bypass(node, _real_mul(rw, node))
        rewritten += 1
    return graph, AfnoRealInfo(rewritten=rewritten, complex_ops_before=before,
                               complex_ops_after=tuple(complex_compute_ops(gm)))
