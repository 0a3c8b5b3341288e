"""Export SDPA's attention dropout without its slow fake-tensor path, then put the probabilities back.

Capture traces in train mode so dropout stays switchable. HF attention then calls
``F.scaled_dot_product_attention(..., dropout_p=p)`` and, with ``p > 0``, torch.export's fake tracing of SDPA
runs the math fallback (matmul, softmax, dropout) op by op under symbolic shapes: on MiniLM at dynamic shapes
that made the export about 60% slower than in eval mode. While exporting, :class:`SdpaDropoutRecorder` (a
thread-local TorchFunctionMode) records each SDPA call's ``dropout_p`` and traces the call with 0;
:func:`restore_sdpa_dropout` then writes the recorded probabilities back onto the graph's SDPA nodes in
program order, where normalisation makes them switchable ``ScaledDotProductAttention`` modules, exactly the
graph the slow export gives. When calls and nodes do not pair up one to one, the caller exports the slow way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA_NODE = torch.ops.aten.scaled_dot_product_attention.default
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DROPOUT_INDEX = _NAMES.index("dropout_p")


@dataclass(frozen=True)
class SdpaCall:
    """One SDPA call seen while exporting: the dropout probability traced as 0 (None: traced as given)."""

    dropout_p: float | None
    is_causal: bool


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_NAMES, args))
    bound.update(kwargs)
    return bound


class SdpaDropoutRecorder(TorchFunctionMode):
    """Records every ``F.scaled_dot_product_attention`` call and traces those with a constant ``dropout_p > 0``
    with ``dropout_p=0`` (the fused op's cheap shape rule); see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = _bind(args, kwargs)
        p = bound.get("dropout_p", 0.0)
        causal = bound.get("is_causal", False)
        if type(p) not in (float, int) or p == 0 or not isinstance(causal, bool):
            self.calls.append(SdpaCall(None, bool(causal) if isinstance(causal, bool) else False))
            return func(*args, **kwargs)
        self.calls.append(SdpaCall(float(p), causal))
        return func(**{**bound, "dropout_p": 0.0})

    @property
    def changed(self) -> bool:
        """True when some call was traced with another dropout than the model asked for."""
        return any(c.dropout_p is not None for c in self.calls)


def _sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """SDPA nodes of ``gm`` in program order, including those of higher-order-op subgraphs (a no_grad region)
    at the point where the region runs."""
    found: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _SDPA_NODE:
            found.append(node)
            continue
        for arg in node.args:
            sub = _subgraph(gm, arg)
            if sub is not None:
                found.extend(_sdpa_nodes(sub))
    return found


def _subgraph(gm: fx.GraphModule, arg: Any) -> fx.GraphModule | None:
    if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
        return None
    try:
        sub = gm.get_submodule(str(arg.target))
    except AttributeError:
        return None
    return sub if isinstance(sub, fx.GraphModule) else None


def restore_sdpa_dropout(gm: fx.GraphModule, calls: list[SdpaCall]) -> bool:
    """Write each recorded call's dropout probability onto its SDPA node; False (``gm`` unchanged) when the
    graph's SDPA nodes and the recorded calls do not pair up one to one in program order."""
    nodes = _sdpa_nodes(gm)
    if len(nodes) != len(calls) or len(set(nodes)) != len(nodes):  # a subgraph run twice: no one-to-one pairing
        return False
    for node, call in zip(nodes, calls):
        bound = _bind(node.args, node.kwargs)
        if bool(bound.get("is_causal", False)) != call.is_causal:
            return False
        if call.dropout_p is not None and float(bound.get("dropout_p", 0.0)) != 0.0:
            return False
    for node, call in zip(nodes, calls):
        if call.dropout_p is None:
            continue
        if len(node.args) > _DROPOUT_INDEX:
            node.args = (*node.args[:_DROPOUT_INDEX], call.dropout_p, *node.args[_DROPOUT_INDEX + 1:])
        else:
            node.kwargs = {**node.kwargs, "dropout_p": call.dropout_p}
    for module in {id(n.graph.owning_module): n.graph.owning_module for n in nodes}.values():
        if isinstance(module, fx.GraphModule):
            module.recompile()
    return True
