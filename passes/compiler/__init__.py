"""Compiler passes: CSE, DCE, hoisting, constant folding, matmul batching, elementwise fusion, and the
pipeline that runs them to a fixed point (what makes the naive, unrolled A-GRU fast)."""

from .batch_matmuls import BatchMatmulsInfo, batch_matmuls_transform_pass
from .cse import CSEInfo, cse_transform_pass
from .dce import DCEInfo, dce_transform_pass
from .fold import FoldInfo, fold_constants_transform_pass
from .fuse_elementwise import FuseElementwiseInfo, fuse_elementwise_transform_pass
from .hoist import HoistInfo, hoist_parameter_subgraphs_transform_pass
from .pipeline import OptimizeInfo, optimize_graph_pipeline

__all__ = [
    "BatchMatmulsInfo",
    "CSEInfo",
    "DCEInfo",
    "FoldInfo",
    "FuseElementwiseInfo",
    "HoistInfo",
    "OptimizeInfo",
    "batch_matmuls_transform_pass",
    "cse_transform_pass",
    "dce_transform_pass",
    "fold_constants_transform_pass",
    "fuse_elementwise_transform_pass",
    "hoist_parameter_subgraphs_transform_pass",
    "optimize_graph_pipeline",
]
