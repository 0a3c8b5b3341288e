"""CompressionPipeline: MASE's name and call shape, ``mg, report = pipe(mg, pass_args={...})``.

The passes named in ``pass_args`` run in the standard order, whatever order the dict lists them in:
prune → shrink → LoRA insertion → fine-tune → LoRA fusion → quantize → calibrate → lower → export. With
``qat=True`` the fine-tune runs after quantization and calibration instead (quantization-aware
training). Every run is an ordinary :class:`Pipeline` (validated first, contracts checked, recorded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..passes.base import PASS_ALIASES
from .pipeline import Pipeline
from .report import PipelineReport
from .steps import PipelineError

__all__ = ["STANDARD_ORDER", "CompressionPipeline"]

STANDARD_ORDER: tuple[str, ...] = (
    "prune_transform_pass",
    "shrink_transform_pass",
    "insert_lora_adapter_transform_pass",
    "finetune",
    "fuse_lora_weights_transform_pass",
    "quantize_transform_pass",
    "calibrate_transform_pass",
    "lower_int8_transform_pass",
    "export",
)
_QAT_ORDER = tuple(n for n in STANDARD_ORDER if n != "finetune")
QAT_ORDER: tuple[str, ...] = (*_QAT_ORDER[:6], "finetune", *_QAT_ORDER[6:])  # fine-tune after calibrate


class CompressionPipeline:
    """``CompressionPipeline()(mg, pass_args={"quantize_transform_pass": qcfg, "prune_transform_pass": pcfg})``.

    ``contracts``: per-pass contract thresholds (e.g. ``{"quantize_transform_pass": {"min_sqnr_db": 20}}``);
    ``verify`` / ``data`` / ``num_batches``: as for :class:`Pipeline`.
    """

    def __init__(self, qat: bool = False, verify: bool = True, data: Any = None, num_batches: int | None = 1,
                 contracts: Mapping[str, Mapping[str, float]] | None = None, name: str = "compression") -> None:
        self.order = QAT_ORDER if qat else STANDARD_ORDER
        self.qat, self.verify, self.data, self.num_batches, self.name = qat, verify, data, num_batches, name
        self.contracts = {k: dict(v) for k, v in (contracts or {}).items()}
        unknown = sorted(k for k in self.contracts if k not in self.order)
        if unknown:
            raise PipelineError(f"CompressionPipeline: contracts for unknown stage(s) {unknown}; stages: "
                                f"{list(self.order)}")

    def build(self, pass_args: Mapping[str, Any]) -> Pipeline:
        """The pipeline ``pass_args`` describes (validated: unknown keys, unregistered passes, bad args)."""
        if not isinstance(pass_args, Mapping):
            raise PipelineError(f"CompressionPipeline: pass_args must be a dict, got {type(pass_args).__name__}")
        pass_args = {PASS_ALIASES.get(k, k): v for k, v in pass_args.items()}  # former pass names still work
        unknown = sorted(str(k)[:100] for k in pass_args if k not in self.order)
        if unknown:
            raise PipelineError(f"CompressionPipeline: unknown pass_args key(s) {unknown}; the standard order "
                                f"is {list(self.order)}")
        if self.qat and "finetune" in pass_args and "insert_lora_adapter_transform_pass" in pass_args:
            raise PipelineError("CompressionPipeline: qat=True fine-tunes the quantized model; LoRA adapters "
                                "are fine-tuned before quantization (use qat=False)")
        steps = [{"pass": n, "args": pass_args[n] if pass_args[n] is not None else {},
                  **({"contract": self.contracts[n]} if n in self.contracts else {})}
                 for n in self.order if n in pass_args]
        return Pipeline(steps, name=self.name, verify=self.verify, data=self.data, num_batches=self.num_batches)

    def __call__(self, graph: ForgeGraph, pass_args: Mapping[str, Any] | None = None,
                 inplace: bool = False) -> tuple[ForgeGraph, PipelineReport]:
        """Run the passes named in ``pass_args`` in the standard order; returns ``(graph, report)``."""
        if not pass_args:
            raise PipelineError(f"CompressionPipeline: pass_args is empty; give args for any of {list(self.order)}")
        return self.build(pass_args)(graph, inplace=inplace)
