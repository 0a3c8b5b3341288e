"""The MiniLM classifier as shipped: the kind of point `make demo`'s search picks, built and measured the same
way by examples/demo.py and benchmarks/bench_minilm_lowered.py.

A point is the fine-tuned fp32 graph with part of every FFN removed (``prune_transform_pass`` on FFN units,
then ``shrink_transform_pass``), every Linear in scaled int8 (per-channel symmetric weights, 8-bit
activations quantized per batch: the arithmetic of the int8 GEMM it is lowered to) and every embedding table
in ``EMBEDDING_BITS``-bit scaled integers with one scale per row (the word embeddings are 12M of MiniLM's
22.7M parameters: linears alone cannot make it 6x smaller). Lowered (``lower_weight_only_transform_pass``),
the linears run ``Int8Linear`` and the embeddings ``WeightOnlyEmbedding``; sizes are measured on disk (the
checkpoint's weights file) and in memory (parameter and buffer bytes), never computed from bit counts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ..graph.forge_graph import ForgeGraph
from ..passes.prune import prune_transform_pass, shrink_transform_pass
from ..passes.quantize import quantize_transform_pass

__all__ = ["EMBEDDING_BITS", "quant_config", "prune_ffn", "ship_point", "lower_point", "disk_bytes",
           "resident_bytes", "linear_macs"]

EMBEDDING_BITS = 4
FFN = {"regex": [r".*intermediate\.dense"]}  # the 6 feed-forward expansions: pruned by whole units


def quant_config(embedding_bits: int = EMBEDDING_BITS, linear_bits: int = 8) -> dict[str, Any]:
    """Linears: per-channel symmetric weights, dynamic per-tensor 8-bit activations; embeddings: per-row."""
    return {"by": "type", "default": {"config": {"name": None}},
            "embedding": {"config": {"name": "scaled_integer", "weight_width": embedding_bits,
                                     "weight_granularity": "per_channel"}},
            "linear": {"config": {"name": "scaled_integer", "weight_width": linear_bits,
                                  "weight_granularity": "per_channel", "data_in_width": 8,
                                  "data_in_symmetric": False, "data_in_dynamic": True}}}


def prune_ffn(base: ForgeGraph, sparsity: float, method: str = "l1",
              calib: tuple[list[dict[str, Any]], Any] | None = None) -> ForgeGraph:
    """A copy of ``base`` with ``sparsity`` of every FFN's units removed (``taylor`` needs ``calib``:
    (batches, loss_fn) as ``Task.calibration`` returns them)."""
    graph = base.copy()
    if sparsity <= 0:
        return graph
    args: dict[str, Any] = {"weight": {"sparsity": sparsity, "method": method, "granularity": "ffn"},
                            "targets": FFN}
    if method == "taylor":
        if calib is None:
            raise ValueError("prune_ffn: method 'taylor' needs calib=(batches, loss_fn) (Task.calibration)")
        args["data"], args["loss_fn"] = calib
    graph, _ = prune_transform_pass(graph, args)
    graph, _ = shrink_transform_pass(graph)
    return graph


def ship_point(base: ForgeGraph, ffn_sparsity: float, method: str = "l1",
               calib: tuple[list[dict[str, Any]], Any] | None = None,
               embedding_bits: int = EMBEDDING_BITS) -> ForgeGraph:
    """The simulated point: FFN shrunk, then linears and embeddings quantized (see the module docstring)."""
    graph = prune_ffn(base, ffn_sparsity, method, calib)
    graph, _ = quantize_transform_pass(graph, quant_config(embedding_bits))
    return graph.eval()


def lower_point(point: ForgeGraph) -> tuple[ForgeGraph, Any]:
    """A lowered copy of ``point`` (every quantized layer on a real kernel, or an error saying which not)."""
    from ..passes.quantize.lower_weight_only import lower_weight_only_transform_pass

    lowered, info = lower_weight_only_transform_pass(point.copy(), {"strict": True})
    return lowered.eval(), info


def disk_bytes(graph: ForgeGraph, keep: str | Path | None = None) -> int:
    """Bytes of the weights file of ``graph``'s checkpoint, exported to ``keep`` (or a temporary folder)."""
    from ..search.measured import checkpoint_weight_bytes

    if keep is not None:
        return checkpoint_weight_bytes(graph.export(keep))
    with tempfile.TemporaryDirectory(prefix="fxforge-ship-") as tmp:
        return checkpoint_weight_bytes(graph.export(Path(tmp) / "ckpt"))


def resident_bytes(graph: ForgeGraph) -> int:
    """Parameter + buffer bytes the graph keeps in memory (kernels' own packed copies are not counted)."""
    model = graph.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def linear_macs(graph: ForgeGraph, tokens: int) -> int:
    """Multiply-accumulates of the graph's Linear-like layers for ``tokens`` rows (the compute ceiling's unit)."""
    total = 0
    for module in graph.model.modules():
        layer: Any = module
        if isinstance(module, torch.nn.Linear) or (getattr(module, "fxforge_op", "") == "linear"
                                                   and hasattr(layer, "in_features")):
            total += int(layer.out_features) * int(layer.in_features) * tokens
    return total
