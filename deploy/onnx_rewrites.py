"""Rewrites of an exported ONNX graph (onnx_ir, before it is saved) that make ONNX Runtime faster without
changing a result the fxforge graph can give.

``drop_softmax_nan_guards``: torch.onnx writes attention with a boolean mask as
``Where(IsNaN(Softmax(scores + mask)), 0, Softmax(...))``, meant for rows masked with -inf. Its own mask is
``Where(mask, 0, finfo.min)``: finite, so the softmax of finite scores is never NaN and the guard only ever
changes a row whose scores are already NaN, where it hides the NaN behind zeros (torch would return NaN). On
MiniLM at 8x128 the guard's two full-size passes per layer were 22% of ONNX Runtime's int8 time (profiled).
"""

from __future__ import annotations

from typing import Any

__all__ = ["drop_softmax_nan_guards"]


def _is_zero(value: Any) -> bool:
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None:
        return False
    array = tensor.numpy()
    return array.size == 1 and float(array.reshape(())) == 0.0


def drop_softmax_nan_guards(model: Any) -> int:
    """Remove every ``Where(IsNaN(p), 0, p)`` whose ``p`` is a Softmax output (top-level graph of the onnx_ir
    ``model``); returns how many were removed. A guard whose result is a graph output is kept."""
    graph = model.graph
    removed = 0
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
            continue
        cond, zero, probs = node.inputs
        isnan = cond.producer() if cond is not None else None
        if isnan is None or isnan.op_type != "IsNaN" or isnan.inputs[0] is not probs:
            continue
        softmax = probs.producer() if probs is not None else None
        out = node.outputs[0]
        if softmax is None or softmax.op_type != "Softmax" or not _is_zero(zero) or out.is_graph_output():
            continue
        out.replace_all_uses_with(probs)
        graph.remove(node, safe=True)
        if not cond.uses():
            graph.remove(isnan, safe=True)
        removed += 1
    return removed
