"""What a graph's quantization state is, derived from the graph: the one walk over quantized nodes
and the graph properties "quantized" and "calibrated" that the quantization passes declare."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch.fx as fx
import torch.nn as nn

from ..contract import holds, register_property
from ..select import iter_layers, select_modules
from .attention import QuantizedSDPA
from .modules import _QuantizedLayer
from .quantizer import Quantize
from .records import QuantizationRecord

if TYPE_CHECKING:
    from ...graph.forge_graph import ForgeGraph

__all__ = ["quantized_nodes", "quantizers", "activation_quantizers"]


def quantized_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, QuantizationRecord]]:
    """(node, record) for every node the quantize pass recorded."""
    return [(layer.node, layer.record) for layer in iter_layers(gm, record=QuantizationRecord)]


def quantizers(root: nn.Module) -> dict[str, Quantize]:
    """Every Quantize module under ``root`` (inside quantized layers too), by path."""
    return {path: q for path, q in select_modules(root, Quantize) if isinstance(q, Quantize)}


def activation_quantizers(root: nn.Module) -> dict[str, Quantize]:
    """The quantizers of activations (not parameters): what calibration observes."""
    return {p: q for p, q in quantizers(root).items() if not q.is_param}


def _simulated(root: nn.Module) -> Iterator[str]:
    for path, module in root.named_modules():
        if isinstance(module, Quantize | _QuantizedLayer | QuantizedSDPA):
            yield path


def _quantized(graph: ForgeGraph) -> bool:
    return any(True for _ in _simulated(graph.model)) or holds("int8-lowered", graph) \
        or holds("weight-only-lowered", graph)


def _calibrated(graph: ForgeGraph) -> bool:
    static = [q for q in quantizers(graph.model).values() if q.needs_calibration]
    return _quantized(graph) and all(q.calibrated for q in static)


register_property("quantized", _quantized, "quantized layers or quantizers are in the graph (quantize_transform_pass)")
register_property("calibrated", _calibrated, "every static activation quantizer has a calibrated scale "
                  "(calibrate_transform_pass)")
