"""Quantization: number formats, MASE-config quantize pass, calibration, QAT, report, int8 and weight-only lowering."""

from . import packed_layers  # noqa: F401  # checkpoints store quantized layers' weights packed
from .attention import QuantizedSDPA
from .awq import awq_transform_pass
from .awq_scale import ChannelScale
from .calibrate import calibrate_analysis_pass, calibrate_transform_pass
from .config import OpQuantConfig, QuantizeConfig, QuantizeConfigError, RoleSpec
from .formats import FORMATS, ROLES
from .gptq import gptq_transform_pass
from .lower import Int8Linear, lower_int8_transform_pass
from .lower_weight_only import lower_weight_only_transform_pass
from .module_pass import calculate_avg_bits_module_analysis_pass, quantize_module_transform_pass
from .modules import QuantizedConv1d, QuantizedConv2d, QuantizedLayerNorm, QuantizedLinear
from .packing import NotPackable, pack_layer_weight, pack_weight  # registers the packed-tensor codecs
from .quantizer import Quantize
from .records import CalibrationRecord, LoweringRecord, QuantizationRecord
from .report import quantization_report_analysis_pass
from .transform import quantize_transform_pass
from .woq_group import WeightOnlyGroupLinear
from .woq_modules import WeightOnlyEmbedding, WeightOnlyInt4Linear, WeightOnlyInt8Linear
from .zeroed import QuantizationWarning

__all__ = [
    "FORMATS",
    "ROLES",
    "CalibrationRecord",
    "ChannelScale",
    "Int8Linear",
    "LoweringRecord",
    "NotPackable",
    "OpQuantConfig",
    "QuantizationRecord",
    "QuantizationWarning",
    "Quantize",
    "QuantizeConfig",
    "QuantizeConfigError",
    "QuantizedConv1d",
    "QuantizedConv2d",
    "QuantizedLayerNorm",
    "QuantizedLinear",
    "QuantizedSDPA",
    "RoleSpec",
    "WeightOnlyEmbedding",
    "WeightOnlyGroupLinear",
    "WeightOnlyInt4Linear",
    "WeightOnlyInt8Linear",
    "awq_transform_pass",
    "calibrate_analysis_pass",
    "calibrate_transform_pass",
    "calculate_avg_bits_module_analysis_pass",
    "gptq_transform_pass",
    "lower_int8_transform_pass",
    "lower_weight_only_transform_pass",
    "pack_layer_weight",
    "pack_weight",
    "quantization_report_analysis_pass",
    "quantize_module_transform_pass",
    "quantize_transform_pass",
]
