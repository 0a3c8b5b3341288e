"""MASE's user-facing names resolve in fxforge (get_pass, pipeline steps) or are refused with the closest
equivalent; the migration guide and ``fxforge inspect --mase-names`` show the same table the code reads."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.cli.app import main
from fxforge.passes import PASSES, get_pass
from fxforge.passes.mase_names import (
    MASE_COMMIT,
    MASE_HARDWARE_COMMIT,
    MASE_NAMES,
    guide_block,
    lookup,
    markdown,
    target_exists,
)
from fxforge.pipelines import Pipeline, PipelineError

# Read from DeepWok/mase at this commit: the names exported by src/chop/passes/{__init__,graph/__init__,
# graph/analysis,graph/transforms,graph/interface,module,module/transforms/{gptq,rotation}}, pipelines/ and
# actions/, and the short keys of passes/graph's PASSES dict (module PASSES' "quantize" and "calculate_avg_bits"
# collide with the graph's; their full names are listed). Kept here, apart from the table, on purpose.
MASE_READ_AT = "6ff398cf4c01a008540fd5ff2431f6e0740b4c5b"
MASE_SHORT = [
    "init_metadata", "add_common_metadata", "add_software_metadata", "profile_statistics", "report_graph",
    "report_node_meta_param", "report_node_shape", "report_node_type", "calculate_avg_bits", "add_pruning_metadata",
    "add_natural_sparsity", "hook_inspection", "verify_common_metadata", "verify_metadata", "verify_software_metadata",
    "load_mase_graph", "load_node_meta_param", "save_mase_graph", "save_node_meta_param", "quantize",
    "summarize_quantization", "prune", "prune_detach_hook", "conv_bn_fusion", "logicnets_fusion", "attention_swap",
]
MASE_FULL = [
    # passes/graph/analysis
    "add_common_metadata_analysis_pass", "add_software_metadata_analysis_pass", "init_metadata_analysis_pass",
    "profile_statistics_analysis_pass", "report_graph_analysis_pass", "report_node_meta_param_analysis_pass",
    "report_node_shape_analysis_pass", "report_node_type_analysis_pass", "calculate_avg_bits_mg_analysis_pass",
    "add_pruning_metadata_analysis_pass", "add_natural_sparsity_metadata_analysis_pass",
    "add_movement_metadata_analysis_pass", "hook_inspection_analysis_pass", "verify_common_metadata_analysis_pass",
    "verify_metadata_analysis_pass", "verify_software_metadata_analysis_pass", "plot_graph_analysis_pass",
    "report_parallelization_analysis_pass", "autosharding_analysis_pass",
    # passes/graph/transforms
    "prune_transform_pass", "prune_detach_hook_transform_pass", "quantize_transform_pass",
    "summarize_quantization_analysis_pass", "conv_bn_fusion_transform_pass", "logicnets_fusion_transform_pass",
    "metadata_value_type_cast_transform_pass", "training_base_pass", "raise_granularity_transform_pass",
    "patch_metadata_transform_pass", "insert_lora_adapter_transform_pass", "fuse_lora_weights_transform_pass",
    # passes/graph/interface
    "load_mase_graph_interface_pass", "save_mase_graph_interface_pass", "save_node_meta_param_interface_pass",
    "load_node_meta_param_interface_pass",
    # passes/module
    "calculate_avg_bits_module_analysis_pass", "report_trainable_parameters_analysis_pass",
    "quantize_module_transform_pass", "attention_swap_transform_pass", "resharding_transform_pass",
    "run_gptq", "rotate_llama", "rotate_qwen3", "fuse_rms_norms", "replace_rms_norms",
    # pipelines, actions
    "AutoPipeline", "CompressionPipeline", "AutoPipelineForDistributedInference",
    "train", "test", "transform", "search",
]
# MASE's hardware and ONNX passes, removed from its main by PR #307; read at the commit before (its tutorials
# still call them): the exports of src/chop/passes/__init__.py and the PASSES keys of passes/graph there
MASE_HARDWARE_READ_AT = "ae4660b14f135e6db00486f9d18e623a07940d60"
MASE_HARDWARE = [
    "add_hardware_metadata_analysis_pass", "report_node_hardware_type_analysis_pass", "run_cosim_analysis_pass",
    "verify_hardware_metadata_analysis_pass", "get_synthesis_results", "onnx_annotate_transform_pass",
    "partition_to_multi_device_transform_pass", "emit_verilog_top_transform_pass", "emit_bram_transform_pass",
    "emit_internal_rtl_transform_pass", "emit_cocotb_transform_pass", "emit_vivado_project_transform_pass",
    "ann2snn_transform_pass", "ann2snn_module_transform_pass", "export_fx_graph_analysis_pass",
    "onnx_runtime_interface_pass",
    "add_hardware_metadata", "report_node_hardware_type", "verify_hardware_metadata", "onnxruntime", "ann2snn",
    "onnx_annotate",
]
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migration.md"


def not_planned_table() -> dict[str, tuple[str, str]]:
    """The guide's "Not planned" table: MASE name -> (closest, why), parsed from the guide's text."""
    text = GUIDE.read_text(encoding="utf-8").split("### Not planned", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.*?) \|$", text, re.M)
    return {name: (closest, why) for name, closest, why in rows}


def test_the_table_was_read_from_the_same_mase_commit() -> None:
    assert (MASE_COMMIT, MASE_HARDWARE_COMMIT) == (MASE_READ_AT, MASE_HARDWARE_READ_AT)


@pytest.mark.parametrize("name", MASE_SHORT + MASE_FULL + MASE_HARDWARE)
def test_every_mase_name_resolves_or_is_listed_with_a_status(name: str) -> None:
    row = lookup(name)
    assert row is not None, f"MASE name {name!r} is missing from passes/mase_names.py"
    if row.kind == "pass" and row.status in ("same", "renamed", "different"):
        assert get_pass(name) is PASSES[row.fxforge]
    elif row.status == "planned":
        if row.kind == "pass" and row.fxforge in PASSES:  # built since: the MASE name runs it
            assert get_pass(name) is PASSES[row.fxforge]
        else:
            with pytest.raises(KeyError, match=f"planned in issue #{row.issue}"):
                get_pass(name)
    elif row.status == "not planned":
        closest, why = not_planned_table()[row.mase]
        assert (closest, why) == (row.fxforge, row.note) and len(why) > 20
        with pytest.raises(KeyError, match=rf"closest in fxforge: {re.escape(row.fxforge)}.*migration.md#not-planned"):
            get_pass(name)
    else:  # an entry point that fxforge has under another name
        assert row.kind == "entry" and target_exists(row), row


def test_the_table_lists_mase_names_only() -> None:
    listed = {r.mase for r in MASE_NAMES} | {r.short for r in MASE_NAMES if r.short}
    assert listed == set(MASE_SHORT) | set(MASE_FULL) | set(MASE_HARDWARE)


def _module_found(path: str) -> bool:
    """Whether a dotted path starts with an fxforge module (found without importing it: deploy is heavy)."""
    parts, found = path.split("."), False
    for k in range(2, len(parts) + 1):
        try:
            found = importlib.util.find_spec(".".join(parts[:k])) is not None or found
        except ModuleNotFoundError:  # the rest of the path names attributes of a module
            break
    return found


def test_what_the_table_points_to_exists() -> None:
    """A resolving row's pass is registered, an entry's import path imports, a refusal's closest name exists."""
    for row in MASE_NAMES:
        if row.status in ("same", "renamed", "different"):
            assert target_exists(row), row
        elif row.status == "not planned" and "issue #32" not in row.note:
            found = row.fxforge in PASSES or "." in row.fxforge and _module_found(row.fxforge)
            assert found or row.fxforge in ("fxforge draw", "export", "finetune"), row


def test_a_name_that_is_neither_fxforge_nor_mase_lists_the_registered_passes() -> None:
    with pytest.raises(KeyError, match="no pass named 'quantise'; registered"):
        get_pass("quantise")


def test_mase_names_as_pipeline_steps() -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8)))
    pipe = Pipeline([{"pass": "init_metadata"}, {"pass": "add_common_metadata"},
                     {"pass": "report_node_type", "args": {"show": False}}, {"pass": "verify_metadata"}])
    out, report = pipe(mg)
    assert [s.name for s in pipe.steps] == ["init_metadata_analysis_pass", "add_common_metadata_analysis_pass",
                                            "report_node_type_analysis_pass", "verify_metadata_analysis_pass"]
    assert [p.name for p in out.history][-2:] == ["report_node_type_analysis_pass", "verify_metadata_analysis_pass"]
    with pytest.raises(PipelineError, match="logicnets_fusion.*closest in fxforge: fuse_kernels_transform_pass"):
        Pipeline([{"pass": "logicnets_fusion"}])


def test_the_guide_holds_the_generated_table() -> None:
    block = guide_block(GUIDE.read_text(encoding="utf-8"))
    assert block == markdown(), ("docs/migration.md's MASE table differs from passes/mase_names.py: run "
                                 "python -c \"from fxforge.passes.mase_names import sync_guide; "
                                 "sync_guide('docs/migration.md')\"")


def test_inspect_mase_names_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--mase-names"]) == 0
    out = capsys.readouterr().out
    for row in MASE_NAMES:
        line = next(line for line in out.splitlines() if line.startswith(row.mase + " "))
        assert row.fxforge in line and row.status in line, line
    assert MASE_COMMIT[:12] in out
