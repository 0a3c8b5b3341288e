"""The ONNX Runtime session settings fxforge's ONNX artifacts are timed with, and recommended for running them.

ORT's ``SkipLayerNormFusion`` turns each residual ``Add`` + ``LayerNormalization`` into one
``SkipLayerNormalization``; with onnxruntime 1.32 on a 2-core Intel Xeon (AVX-512) that fused CPU kernel took
0.9 ms per call on the MiniLM classifier at 8x128 (12 calls, a third of the shrunk int8 artifact's kernel time)
where the unfused LayerNormalization took 0.13 ms. Disabled, the fp32 artifact went 87.9 -> 79.5 ms and the int8
ones 32-41 -> 23-32 ms, outputs equal within float rounding (9.5e-7 on fp32 logits). Outputs do not depend on
the setting; only time does, so it is a recommendation (``session_options``), not part of the artifact.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DISABLED_OPTIMIZERS", "session_options", "session_kwargs"]

DISABLED_OPTIMIZERS: tuple[str, ...] = ("SkipLayerNormFusion",)


def session_options(threads: int | None = None) -> Any:
    """``onnxruntime.SessionOptions`` with every graph optimisation on and ``threads`` intra-op threads."""
    ort = importlib.import_module("onnxruntime")
    opts = ort.SessionOptions()
    if threads is not None:
        opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


def session_kwargs(threads: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``onnxruntime.InferenceSession`` (options, CPU provider, disabled optimizers)."""
    return {"sess_options": session_options(threads), "providers": ["CPUExecutionProvider"],
            "disabled_optimizers": list(DISABLED_OPTIMIZERS)}
