"""remove_dropout_transform_pass: drop dropout nodes (MASE tutorial 1's example transform)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.modules import ScaledDotProductAttention
from ..base import NoArgs, forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import GraphRewrite


def _dropout_free(graph: ForgeGraph) -> bool:
    gm = graph.model
    return not any(n.op in ("call_module", "call_function", "call_method") and classify(n, gm)[1] == "dropout"
                   for n in gm.graph.nodes)


register_property("dropout-free", _dropout_free, "no dropout node is left in the graph (remove_dropout_transform_pass)")


@dataclass(frozen=True)
class RemoveDropoutInfo(PassInfo):
    """removed: dropout nodes erased; attention_dropout_disabled: attention modules whose dropout_p
    was set to 0; dropout_modules_left: nn.Dropout modules still reachable (inside leaf layers)."""

    removed: int
    attention_dropout_disabled: int
    dropout_modules_left: int


@forge_pass("transform", NoArgs, info=RemoveDropoutInfo, ensures=("dropout-free",),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="dropout is the identity in eval mode"))
def remove_dropout_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, RemoveDropoutInfo]:
    """Rewire each dropout's users to its input and erase it; attention dropout is set to 0.

    Contract: eval-mode outputs are unchanged (dropout is the identity in eval).
    """
    gm = graph.model
    with GraphRewrite(gm) as rw:
        for node in list(gm.graph.nodes):
            if node.op in ("call_module", "call_function", "call_method") and classify(node, gm)[1] == "dropout":
                rw.bypass(node, node.args[0] if node.args else node.kwargs["input"])
        attention = 0
        for node in gm.graph.nodes:
            if node.op != "call_module":
                continue
            module = gm.get_submodule(str(node.target))
            if isinstance(module, ScaledDotProductAttention) and module.dropout_p:
                module.dropout_p = 0.0
                attention += 1
                rw.touch(node)
    leftover = sum(isinstance(m, nn.Dropout) for m in gm.modules())
    return graph, RemoveDropoutInfo(removed=rw.erased, attention_dropout_disabled=attention,
                                    dropout_modules_left=leftover)
