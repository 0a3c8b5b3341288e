"""fuse_kernels_transform_pass: put the fused ``torch.ops.fxforge.*`` kernels into a captured graph.

``fuse_kernels_transform_pass(mg, {"patterns": [...], "targets": selector, "exclude": selector})``
replaces, in either frontend's graph, the patterns of passes/transform/fusion_patterns.py by the
kernels of ``fxforge.kernels``: on CUDA they run Triton, on CPU their torch references (same graph).
``targets`` / ``exclude`` use the shared selector (passes/select.py: one meaning in every pass) on
each pattern's anchor node: the softmax (or the division ending the naive chain), the LayerNorm, the
activation after a linear. Omitted ``targets``: every anchor; an empty one is refused.
Run it last: fused linears become ``F.linear`` calls on the same parameters (``get_attr``), so passes
that swap ``nn.Linear`` modules (LoRA, quantize) no longer see them.

Contract: outputs and gradients equal the unfused graph within atol/rtol 1e-5 (fp32; the kernels
reassociate row sums). A graph without the patterns is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from ... import kernels  # noqa: F401  (registers torch.ops.fxforge.*)
from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import GraphRewrite
from ..select import EVERY, parse_selector_fields, select_nodes
from .fusion_patterns import fuse_bias_activation, fuse_layer_norm, fuse_softmax, fuse_softmax_chain

PATTERNS: tuple[str, ...] = ("softmax", "softmax_chain", "add_layer_norm", "layer_norm", "bias_activation")
DEFAULT_PATTERNS: tuple[str, ...] = ("softmax", "softmax_chain", "add_layer_norm", "bias_activation")
FUSED_KINDS: tuple[str, ...] = ("softmax", "scaled_masked_softmax", "softmax_chain", "add_layer_norm",
                                "layer_norm", "bias_gelu", "bias_relu")


def _fused_nodes(graph: ForgeGraph) -> bool:
    return any(n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "fxforge"
               for n in graph.model.graph.nodes)


register_property("fused-kernels", _fused_nodes, "the graph calls fused torch.ops.fxforge kernels")


@dataclass(frozen=True)
class FuseKernelsArgs:
    """patterns: which of PATTERNS to fuse ("layer_norm" = a LayerNorm without an add, off by default);
    targets / exclude: selectors on each pattern's anchor node (targets None: every match)."""

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    targets: Any = None
    exclude: Any = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.patterns) - set(PATTERNS))
        if unknown:
            raise ValueError(f"unknown pattern(s) {unknown}; allowed: {list(PATTERNS)}")
        parse_selector_fields(self)


@dataclass(frozen=True)
class FuseKernelsInfo(PassInfo):
    """fused: count per fused kind; nodes_before / nodes_after: graph sizes; names: the anchors fused."""

    fused: dict[str, int] = field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    names: tuple[str, ...] = ()


def _matchers(patterns: tuple[str, ...]) -> list[Callable[[GraphRewrite, fx.Node], str | None]]:
    out: list[Callable[[GraphRewrite, fx.Node], str | None]] = []
    if "softmax_chain" in patterns:
        out.append(fuse_softmax_chain)
    if "softmax" in patterns:
        out.append(fuse_softmax)
    if "add_layer_norm" in patterns or "layer_norm" in patterns:
        with_add, alone = "add_layer_norm" in patterns, "layer_norm" in patterns
        out.append(lambda rw, n: fuse_layer_norm(rw, n, with_add, alone))
    if "bias_activation" in patterns:
        out.append(fuse_bias_activation)
    return out


@forge_pass("transform", FuseKernelsArgs, info=FuseKernelsInfo, requires=("shapes",), ensures=(),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5,
                                       note="fused kernels reassociate fp32 row sums; gradients too"))
def fuse_kernels_transform_pass(graph: ForgeGraph, args: FuseKernelsArgs) -> tuple[ForgeGraph, FuseKernelsInfo]:
    """Replace softmax / add+LayerNorm / bias+activation patterns by fused fxforge kernels."""
    gm = graph.model
    before = len(gm.graph.nodes)
    fused: dict[str, int] = {}
    names: list[str] = []
    for matcher in _matchers(args.patterns):
        for node, name, _, _ in list(select_nodes(gm, EVERY if args.targets is None else args.targets, args.exclude)):
            if node.graph is not gm.graph or node not in gm.graph.nodes:
                continue  # erased by an earlier fusion
            rw = GraphRewrite(gm)  # one rewrite per match, so later matches see derived metadata;
            kind = matcher(rw, node)  # matchers edit only once their whole pattern holds
            if kind is not None:
                rw.finish()
                fused[kind] = fused.get(kind, 0) + 1
                names.append(name)
    return graph, FuseKernelsInfo(fused=fused, nodes_before=before, nodes_after=len(gm.graph.nodes),
                                  names=tuple(names))
