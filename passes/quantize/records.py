"""Typed node metadata written by the quantization passes (JSON round-trip through checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...graph.metadata import MetaRecord, register_record

__all__ = ["QuantizationRecord", "CalibrationRecord", "LoweringRecord"]


@dataclass
class QuantizationRecord(MetaRecord):
    """How a node is quantized.

    ``config`` is the op config in MASE's flat form with defaults filled in; ``rule`` the config key
    that selected it (None: the default); ``quantizers`` maps each role to the module path of its
    quantizer (``weight`` -> ``bert.encoder.layer.0.attention.self.query.weight_quantizer``).
    """

    op: str = ""
    format: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    rule: str | None = None
    quantizers: dict[str, str] = field(default_factory=dict)


@dataclass
class CalibrationRecord(MetaRecord):
    """Calibration statistics per quantizer path: ``{"min": .., "max": .., "scale": .., ...}``.

    Values are floats (per tensor) or lists (per channel); ``method`` is ``minmax`` or ``percentile``.
    """

    method: str = "minmax"
    percentile: float | None = None
    num_batches: int = 0
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)


register_record("software.quantization")(QuantizationRecord)
register_record("software.calibration")(CalibrationRecord)


@dataclass
class LoweringRecord(MetaRecord):
    """A node whose simulated quantized layer was replaced by a real low-precision kernel."""

    kernel: str = ""
    weight: str = "int8 per-channel symmetric"
    activation: str = "uint8 per-tensor dynamic"


register_record("software.lowering")(LoweringRecord)
