"""remove_dropout_transform_pass: drop dropout nodes (MASE tutorial 1's example transform)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.modules import ScaledDotProductAttention
from ..base import NoArgs, forge_pass


@forge_pass("transform", NoArgs)
def remove_dropout_transform_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, dict[str, Any]]:
    """Rewire each dropout's users to its input and erase it; attention dropout is set to 0.

    Contract: eval-mode outputs are unchanged (dropout is the identity in eval).
    """
    gm = graph.model
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op in ("call_module", "call_function") and classify(node, gm)[1] == "dropout":
            source = node.args[0] if node.args else node.kwargs["input"]
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            removed += 1
    attention = 0
    for module in gm.modules():
        if isinstance(module, ScaledDotProductAttention) and module.dropout_p:
            module.dropout_p = 0.0
            attention += 1
    gm.delete_all_unused_submodules()
    leftover = sum(isinstance(m, nn.Dropout) for m in gm.modules())
    return graph, {"removed": removed, "attention_dropout_disabled": attention, "dropout_modules_left": leftover}
