"""Every fxforge pass by name: ``from fxforge import passes; passes.count_op_analysis_pass(mg)``."""

from .analysis.causality import causality_analysis_pass
from .analysis.count_op import count_op_analysis_pass
from .analysis.liveness import liveness_analysis_pass
from .analysis.metadata import add_common_metadata_analysis_pass, init_metadata_analysis_pass
from .analysis.natural_sparsity import add_natural_sparsity_metadata_analysis_pass
from .analysis.profile import profile_analysis_pass
from .analysis.profile_statistics import profile_statistics_analysis_pass
from .analysis.report_graph import report_graph_analysis_pass
from .analysis.report_node import (
    report_node_meta_param_analysis_pass,
    report_node_shape_analysis_pass,
    report_node_type_analysis_pass,
)
from .analysis.sensitivity import sensitivity_analysis_pass
from .analysis.software_metadata import add_software_metadata_analysis_pass
from .analysis.trainable_params import report_trainable_parameters_analysis_pass
from .analysis.verify_metadata import (
    verify_common_metadata_analysis_pass,
    verify_metadata_analysis_pass,
    verify_software_metadata_analysis_pass,
)
from .base import PASS_ALIASES, PASSES, PassArgsError, PassError, forge_pass, get_pass
from .compiler import (
    batch_matmuls_transform_pass,
    cse_transform_pass,
    dce_transform_pass,
    fold_constants_transform_pass,
    fuse_elementwise_transform_pass,
    hoist_parameter_subgraphs_transform_pass,
    optimize_graph_pipeline,
)
from .contract import (
    ContractError,
    EmptyInfo,
    NumericalContract,
    PassInfo,
    current_properties,
    holds,
    register_property,
)
from .lora_checkpoint import load_lora_adapters, save_lora_adapters
from .memory.activation_checkpoint import activation_checkpoint_transform_pass
from .memory.buffer_reuse import buffer_reuse_transform_pass
from .prune import (
    add_movement_metadata_analysis_pass,
    hook_inspection_analysis_pass,
    prune_detach_hook_analysis_pass,
    prune_transform_pass,
    shrink_transform_pass,
)
from .quantize import (
    awq_transform_pass,
    calculate_avg_bits_module_analysis_pass,
    calibrate_analysis_pass,
    calibrate_transform_pass,
    gptq_transform_pass,
    lower_int8_transform_pass,
    lower_weight_only_transform_pass,
    quantization_report_analysis_pass,
    quantize_module_transform_pass,
    quantize_transform_pass,
)
from .transform.afno_real import afno_real_arithmetic_transform_pass
from .transform.attention_swap import attention_swap_transform_pass
from .transform.conv_bn_fusion import conv_bn_fusion_transform_pass
from .transform.freeze import freeze_transform_pass, unfreeze_transform_pass
from .transform.fuse_kernels import fuse_kernels_transform_pass
from .transform.lora import fuse_lora_weights_transform_pass, insert_lora_adapter_transform_pass
from .transform.mask_free import mask_free_activations_transform_pass
from .transform.remove_dropout import remove_dropout_transform_pass
from .transform.rotate_hadamard import rotate_hadamard_transform_pass
from .transform.split_stages import split_stages_transform_pass

__all__ = [
    "PASSES",
    "PASS_ALIASES",
    "PassArgsError",
    "PassError",
    "ContractError",
    "EmptyInfo",
    "NumericalContract",
    "PassInfo",
    "current_properties",
    "holds",
    "register_property",
    "add_common_metadata_analysis_pass",
    "causality_analysis_pass",
    "count_op_analysis_pass",
    "liveness_analysis_pass",
    "profile_analysis_pass",
    "forge_pass",
    "get_pass",
    "init_metadata_analysis_pass",
    "remove_dropout_transform_pass",
    "split_stages_transform_pass",
    "report_graph_analysis_pass",
    "sensitivity_analysis_pass",
    "report_trainable_parameters_analysis_pass",
    "freeze_transform_pass",
    "unfreeze_transform_pass",
    "insert_lora_adapter_transform_pass",
    "save_lora_adapters",
    "load_lora_adapters",
    "fuse_lora_weights_transform_pass",
    "quantize_transform_pass",
    "gptq_transform_pass",
    "awq_transform_pass",
    "rotate_hadamard_transform_pass",
    "quantize_module_transform_pass",
    "conv_bn_fusion_transform_pass",
    "attention_swap_transform_pass",
    "calculate_avg_bits_module_analysis_pass",
    "calibrate_analysis_pass",
    "calibrate_transform_pass",
    "quantization_report_analysis_pass",
    "lower_int8_transform_pass",
    "lower_weight_only_transform_pass",
    "prune_transform_pass",
    "shrink_transform_pass",
    "add_movement_metadata_analysis_pass",
    "add_natural_sparsity_metadata_analysis_pass",
    "prune_detach_hook_analysis_pass",
    "hook_inspection_analysis_pass",
    "fuse_kernels_transform_pass",
    "afno_real_arithmetic_transform_pass",
    "mask_free_activations_transform_pass",
    "cse_transform_pass",
    "dce_transform_pass",
    "hoist_parameter_subgraphs_transform_pass",
    "fold_constants_transform_pass",
    "batch_matmuls_transform_pass",
    "fuse_elementwise_transform_pass",
    "optimize_graph_pipeline",
    "activation_checkpoint_transform_pass",
    "buffer_reuse_transform_pass",
    "add_software_metadata_analysis_pass",
    "profile_statistics_analysis_pass",
    "report_node_meta_param_analysis_pass",
    "report_node_shape_analysis_pass",
    "report_node_type_analysis_pass",
    "verify_common_metadata_analysis_pass",
    "verify_metadata_analysis_pass",
    "verify_software_metadata_analysis_pass",
]
