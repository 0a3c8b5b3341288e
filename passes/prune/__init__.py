"""Pruning: MASE-config masks (element-wise, rows, heads, FFN units; l1 / l2 / random / taylor / movement scores)
and dependency-aware shrinking; MASE's hook passes accepted as no-ops."""

from .groups import DependencyGraph, GroupError, analyse_dependencies
from .mase_hooks import hook_inspection_analysis_pass, prune_detach_hook_analysis_pass
from .modules import PrunedConv1d, PrunedConv2d, PrunedLinear
from .movement import MovementRecord, MovementTracker, add_movement_metadata_analysis_pass
from .prune import LayerSparsity, PruneInfo, prune_transform_pass
from .quantized import QuantizedPrunedLinear
from .shrink import ShrinkInfo, shrink_transform_pass

__all__ = ["prune_transform_pass", "shrink_transform_pass", "add_movement_metadata_analysis_pass", "MovementRecord",
           "MovementTracker", "prune_detach_hook_analysis_pass", "hook_inspection_analysis_pass", "PruneInfo",
           "ShrinkInfo", "LayerSparsity", "PrunedLinear", "QuantizedPrunedLinear", "PrunedConv1d", "PrunedConv2d",
           "GroupError", "DependencyGraph", "analyse_dependencies"]
