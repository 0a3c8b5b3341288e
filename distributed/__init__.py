"""Beyond one process: torch.distributed entry points (DDP trials for search workers; see each module).

Nothing here is imported with ``fxforge``: each name loads its module (and torch.distributed) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"DDPError": "ddp", "DDPOptions": "ddp", "init_group": "ddp", "launch": "ddp", "launched_by_torchrun": "ddp",
         "shard_rows": "ddp", "shard_weight": "ddp",
         "PipelineError": "pipeline", "PipelineResult": "pipeline", "pipeline_run": "pipeline",
         "pipeline_train_step": "pipeline", "PipelineJob": "pipeline", "pipeline_job": "pipeline",
         "run_pipeline_jobs": "pipeline", "VocabLayers": "vocab_parallel"}
_LAZY.update({name: "tensor_parallelism" for name in (
    "TPBlock", "TensorParallelError", "TensorParallelInfo", "TensorParallelPlan", "localize_graph", "tensor_parallel",
    "tensor_parallel_plan")})

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """The public name from its module, imported on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'fxforge.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
