"""Pruning: MASE-config masks (element-wise, rows, heads, FFN units) and dependency-aware shrinking."""

from .groups import DependencyGraph, GroupError, analyse_dependencies
from .modules import PrunedConv1d, PrunedConv2d, PrunedLinear
from .prune import LayerSparsity, PruneInfo, prune_transform_pass
from .quantized import QuantizedPrunedLinear
from .shrink import ShrinkInfo, shrink_transform_pass

__all__ = ["prune_transform_pass", "shrink_transform_pass", "PruneInfo", "ShrinkInfo", "LayerSparsity",
           "PrunedLinear", "QuantizedPrunedLinear", "PrunedConv1d", "PrunedConv2d", "GroupError", "DependencyGraph",
           "analyse_dependencies"]
