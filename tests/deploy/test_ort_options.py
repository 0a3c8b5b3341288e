"""deploy/ort_options.py: the recommended ONNX Runtime session keeps every graph optimisation but the
SkipLayerNorm fusion (slow on CPU with onnxruntime 1.32), and computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from fxforge.deploy.ort_options import DISABLED_OPTIMIZERS, session_kwargs


def _residual_layer_norm(path: Path) -> Path:
    """x + skip, then LayerNormalization: the pattern ORT fuses into SkipLayerNormalization."""
    rng = np.random.default_rng(0)
    gamma, beta = (helper.make_tensor(n, TensorProto.FLOAT, [8], rng.standard_normal(8).astype(np.float32))
                   for n in ("gamma", "beta"))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "skip"], ["s"]),
         helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)],
        "residual_ln", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4, 8]) for n in ("x", "skip")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])], [gamma, beta])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _optimized_ops(model: Path, out: Path, **kwargs: object) -> tuple[list[str], np.ndarray]:
    opts = kwargs.pop("sess_options", None) or ort.SessionOptions()
    opts.optimized_model_filepath = str(out)
    session = ort.InferenceSession(str(model), opts, **kwargs)
    rng = np.random.default_rng(1)
    feed = {n: rng.standard_normal((2, 4, 8)).astype(np.float32) for n in ("x", "skip")}
    y = session.run(None, feed)[0]
    return [n.op_type for n in onnx.load(str(out)).graph.node], y


def test_session_without_skip_layer_norm_fusion_same_outputs(tmp_path: Path) -> None:
    model = _residual_layer_norm(tmp_path / "m.onnx")
    fused, y_fused = _optimized_ops(model, tmp_path / "default.onnx", providers=["CPUExecutionProvider"])
    kwargs = session_kwargs(threads=1)
    assert kwargs["sess_options"].intra_op_num_threads == 1 and DISABLED_OPTIMIZERS == ("SkipLayerNormFusion",)
    ops, y = _optimized_ops(model, tmp_path / "ours.onnx", **kwargs)
    assert "SkipLayerNormalization" in fused  # what ORT does by default
    assert "SkipLayerNormalization" not in ops and "LayerNormalization" in ops
    np.testing.assert_allclose(y, y_fused, rtol=1e-5, atol=1e-6)
