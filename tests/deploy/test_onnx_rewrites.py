"""deploy/onnx_rewrites: the softmax NaN guard torch.onnx writes for boolean attention masks is dropped, any other
Where(IsNaN) is kept (tests/deploy/test_export_float.py checks a real BERT export without it equals the graph)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest

from fxforge.deploy.onnx_rewrites import drop_softmax_nan_guards


def _guarded(first_op: str) -> tuple[Any, Any]:
    """y = Where(IsNaN(p), 0, p) with p = first_op(x), and z = p * 2 beside it."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    p = ir.node(first_op, [x])
    zero = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(0.0, np.float32))})
    isnan = ir.node("IsNaN", [p.outputs[0]])
    where = ir.node("Where", [isnan.outputs[0], zero.outputs[0], p.outputs[0]])
    two = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(2.0, np.float32))})
    mul = ir.node("Mul", [where.outputs[0], two.outputs[0]])
    mul.outputs[0].name = "y"
    graph = ir.Graph([x], [mul.outputs[0]], nodes=[p, zero, isnan, where, two, mul], opset_imports={"": 20})
    return ir.Model(graph, ir_version=10), graph


@pytest.mark.parametrize("first_op", ["Softmax", "Relu"])
def test_only_the_guard_after_a_softmax_is_dropped(first_op: str) -> None:
    model, graph = _guarded(first_op)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    before = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]
    removed = drop_softmax_nan_guards(model)
    ops = [n.op_type for n in graph]
    if first_op == "Softmax":
        assert removed == 1 and "IsNaN" not in ops and "Where" not in ops
    else:
        assert removed == 0 and "IsNaN" in ops and "Where" in ops
    after = ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(after, before)
