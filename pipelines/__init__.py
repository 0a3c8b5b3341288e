"""Pipelines: passes composed from Python, a dict or a TOML file, validated before anything runs,
each transform's numerical contract checked after it runs, replayable from a checkpoint's history."""

from .compression import QAT_ORDER, STANDARD_ORDER, CompressionPipeline
from .generation import generate
from .pipeline import PIPELINE_RECORD, ContractViolation, Pipeline
from .presets import PRESETS
from .report import PipelineReport, StepReport
from .steps import ACTIONS, PipelineError, Step
from .verify import ContractResult

__all__ = [
    "ACTIONS",
    "CompressionPipeline",
    "PRESETS",
    "QAT_ORDER",
    "STANDARD_ORDER",
    "PIPELINE_RECORD",
    "ContractResult",
    "ContractViolation",
    "Pipeline",
    "PipelineError",
    "PipelineReport",
    "Step",
    "StepReport",
    "generate",
]
