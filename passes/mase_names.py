"""MASE's pass names in fxforge: the one table, read by ``get_pass``, pipelines, the migration guide and the CLI.

Every user-facing name of MASE (``chop``, DeepWok/mase at :data:`MASE_COMMIT`) has one row: its full name,
its short ``PASSES`` key when it has one, the fxforge name it maps to and a status. A name that resolves
(``same`` / ``renamed`` / ``different``, or ``planned`` once the pass is registered) runs the fxforge pass;
any other is refused naming the closest fxforge equivalent and the guide's section. docs/migration.md holds
:func:`markdown` verbatim (a test keeps them equal); ``fxforge inspect --mase-names`` prints :func:`rows`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .base import PASSES

__all__ = ["MASE_COMMIT", "MASE_HARDWARE_COMMIT", "MASE_NAMES", "GUIDE", "MaseName", "MaseNameRefused", "guide_block",
           "lookup", "markdown", "mase_pass_name", "rows", "sync_guide", "target_exists"]

MASE_COMMIT = "6ff398cf4c01a008540fd5ff2431f6e0740b4c5b"  # DeepWok/mase main, read 2026-11 (2026-04-23 commit)
# MASE's hardware and ONNX passes left main with PR #307 (1d2044f1, 2026-02); its tutorials (Verilog emission)
# still call them, so they are listed too, as read at the commit before that removal
MASE_HARDWARE_COMMIT = "ae4660b14f135e6db00486f9d18e623a07940d60"
GUIDE = "docs/migration.md"
SECTION_NAMES = "mase-pass-names"  # the guide's anchor for the whole table
SECTION_NOT_PLANNED = "not-planned"  # ... and for the names fxforge will not provide

Status = Literal["same", "renamed", "different", "planned", "not planned"]
STATUSES: tuple[str, ...] = ("same", "renamed", "different", "planned", "not planned")


class MaseNameRefused(KeyError):
    """A MASE name fxforge does not provide (yet, or at all); the message names the closest equivalent."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is read by people
        return str(self.args[0])


@dataclass(frozen=True)
class MaseName:
    """One MASE name: ``mase`` (full), ``short`` (its PASSES key), what fxforge offers and how it differs.

    ``fxforge``: a pass name (kind ``pass``: the pass it runs, will run once registered, or the closest one)
    or a dotted import path / command (kind ``entry``: fxforge has it, but not as a pass). ``issue``: the
    issue that plans it. ``note``: what to change, or why it is not planned.
    """

    mase: str
    fxforge: str
    status: Status
    note: str = ""
    short: str = ""
    kind: Literal["pass", "entry"] = "pass"
    issue: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"{self.mase}: status {self.status!r} is not one of {STATUSES}")
        if (self.status == "planned") != (self.issue is not None):
            raise ValueError(f"{self.mase}: a planned name gives its issue, and only a planned one")
        if self.status in ("different", "not planned") and not self.note:
            raise ValueError(f"{self.mase}: a {self.status!r} name says why in its note")


def _p(mase: str, fxforge: str, status: Status, note: str = "", short: str = "", issue: int | None = None) -> MaseName:
    return MaseName(mase, fxforge, status, note, short, "pass", issue)


def _e(mase: str, fxforge: str, status: Status, note: str = "", issue: int | None = None) -> MaseName:
    return MaseName(mase, fxforge, status, note, "", "entry", issue)


_DIST = "issue #32 plans torch.distributed (pipeline stages, DTensor tensor parallel) instead of MASE's ILP sharding"
_META_FILE = "metadata is saved and checked with the checkpoint (mg.export / ForgeGraph.from_checkpoint), never pickled"

MASE_NAMES: tuple[MaseName, ...] = (
    # passes/graph/analysis
    _p("init_metadata_analysis_pass", "init_metadata_analysis_pass", "same", short="init_metadata"),
    _p("add_common_metadata_analysis_pass", "add_common_metadata_analysis_pass", "same",
       "`add_value: True` is refused (metadata records shapes, dtypes and precisions, never tensor values)",
       short="add_common_metadata"),
    _p("add_software_metadata_analysis_pass", "add_software_metadata_analysis_pass", "same",
       "a typed record per node listing its entries (data_in_*, parameters, buffers, data_out_*)",
       short="add_software_metadata"),
    _p("profile_statistics_analysis_pass", "profile_statistics_analysis_pass", "different",
       "`input_generator` becomes `data` (batches); statistics are streamed, `record` (keeps every value) is "
       "refused, `dims` other than \"all\" are refused; results are typed records and the info",
       short="profile_statistics"),
    _p("report_graph_analysis_pass", "report_graph_analysis_pass", "same", "`file_name` accepted for `file`",
       short="report_graph"),
    _p("report_node_meta_param_analysis_pass", "report_node_meta_param_analysis_pass", "same",
       short="report_node_meta_param"),
    _p("report_node_shape_analysis_pass", "report_node_shape_analysis_pass", "same", short="report_node_shape"),
    _p("report_node_type_analysis_pass", "report_node_type_analysis_pass", "same", short="report_node_type"),
    _p("calculate_avg_bits_mg_analysis_pass", "quantization_report_analysis_pass", "different",
       "info.avg_weight_bits / info.avg_activation_bits (MASE: `w_avg_bit` / `data_avg_bit`), plus each "
       "quantized node's SQNR", short="calculate_avg_bits"),
    _p("add_pruning_metadata_analysis_pass", "prune_transform_pass", "not planned",
       "prune_transform_pass's info already reports each layer's weight and activation sparsity; masks live "
       "in the pruned modules, not in metadata", short="add_pruning_metadata"),
    _p("add_natural_sparsity_metadata_analysis_pass", "add_natural_sparsity_metadata_analysis_pass", "different",
       "records the fraction of exact zeros (MASE's `natural_sparsity` was the fraction of non-zeros) per effective "
       "weight and input activation in a typed record; `dummy_in` becomes `data` (batches); `add_meta` is refused "
       "(always recorded)", short="add_natural_sparsity"),
    _p("add_movement_metadata_analysis_pass", "add_movement_metadata_analysis_pass", "different",
       "MASE only attaches zero scores to the modules; fxforge also accumulates -w * grad per optimizer step "
       "(`info.tracker.step()`, or pass `trainer`) into typed records that prune's method \"movement\" reads"),
    _p("hook_inspection_analysis_pass", "hook_inspection_analysis_pass", "different",
       "a no-op with a one-line notice: fxforge's pruning installs no hooks; lists any user hooks on Linear / "
       "Conv modules in info.hooks", short="hook_inspection"),
    _p("verify_common_metadata_analysis_pass", "verify_common_metadata_analysis_pass", "different",
       "compares every node with a fresh analysis (MASE: local checks of a few ops) and reports every mismatch; "
       "raises unless `raise_on_mismatch: False`", short="verify_common_metadata"),
    _p("verify_software_metadata_analysis_pass", "verify_software_metadata_analysis_pass", "different",
       "checks records, entries and statistics (MASE's checks nothing yet)", short="verify_software_metadata"),
    _p("verify_metadata_analysis_pass", "verify_metadata_analysis_pass", "same", "both checks, every mismatch",
       short="verify_metadata"),
    _p("plot_graph_analysis_pass", "fxforge draw", "not planned",
       "drawing is not a pass: `fxforge draw` draws the module hierarchy with Graphviz, `mg.draw(path)` an SVG of "
       "every node without it"),
    _p("report_parallelization_analysis_pass", "split_stages_transform_pass", "not planned", _DIST),
    _p("autosharding_analysis_pass", "split_stages_transform_pass", "not planned", _DIST),
    # passes/graph/transforms
    _p("quantize_transform_pass", "quantize_transform_pass", "same", "MASE's config language and formats",
       short="quantize"),
    _p("summarize_quantization_analysis_pass", "quantization_report_analysis_pass", "different",
       "`original_graph` becomes `baseline`; `save_dir` is dropped (the info holds the rows; print_table prints them)",
       short="summarize_quantization"),
    _p("prune_transform_pass", "prune_transform_pass", "same", "MASE's `weight` / `activation` config", short="prune"),
    _p("prune_detach_hook_transform_pass", "prune_detach_hook_analysis_pass", "different",
       "a no-op with a one-line notice: fxforge's masks are buffers applied in the pruned layers' forward, there "
       "is no hook to detach", short="prune_detach_hook"),
    _p("conv_bn_fusion_transform_pass", "conv_bn_fusion_transform_pass", "same",
       "BatchNorm folded into the preceding conv / linear of an eval graph", short="conv_bn_fusion"),
    _p("logicnets_fusion_transform_pass", "fuse_kernels_transform_pass", "not planned",
       "LogicNets truth-table fusion targets MASE's LUT hardware flow; fxforge's hardware is issue #33's "
       "fixed-point SystemVerilog", short="logicnets_fusion"),
    _p("metadata_value_type_cast_transform_pass", "add_common_metadata_analysis_pass", "not planned",
       "metadata holds typed JSON values, never tensors: there is nothing to cast"),
    _p("training_base_pass", "finetune", "not planned",
       "training is not a graph pass: the pipeline step `finetune` or fxforge.data.get_trainer"),
    _p("raise_granularity_transform_pass", "init_metadata_analysis_pass", "not planned",
       "fxforge captures HF models with module calls kept (graph/normalize lifts them), so there is no "
       "ONNX-level graph to raise"),
    _p("patch_metadata_transform_pass", "add_common_metadata_analysis_pass", "not planned",
       "precisions of every node (Python builtins included) are recorded by the metadata pass; a quantized "
       "node's format is in its QuantizationRecord"),
    _p("insert_lora_adapter_transform_pass", "insert_lora_adapter_transform_pass", "same"),
    _p("fuse_lora_weights_transform_pass", "fuse_lora_weights_transform_pass", "same"),
    # passes/graph/interface
    _p("load_mase_graph_interface_pass", "fxforge.graph.forge_graph.ForgeGraph.from_checkpoint", "not planned",
       _META_FILE, short="load_mase_graph"),
    _p("save_mase_graph_interface_pass", "export", "not planned",
       _META_FILE + "; in a pipeline, the step `export`", short="save_mase_graph"),
    _p("load_node_meta_param_interface_pass", "fxforge.graph.forge_graph.ForgeGraph.from_checkpoint", "not planned",
       _META_FILE, short="load_node_meta_param"),
    _p("save_node_meta_param_interface_pass", "export", "not planned", _META_FILE, short="save_node_meta_param"),
    # passes/module
    _p("calculate_avg_bits_module_analysis_pass", "calculate_avg_bits_module_analysis_pass", "same",
       "on a plain nn.Module"),
    _p("report_trainable_parameters_analysis_pass", "report_trainable_parameters_analysis_pass", "same"),
    _p("quantize_module_transform_pass", "quantize_module_transform_pass", "same",
       "the graph pass's config language, formats and quantized modules, on a plain nn.Module"),
    _p("attention_swap_transform_pass", "attention_swap_transform_pass", "planned", short="attention_swap",
       issue=35),
    _p("resharding_transform_pass", "split_stages_transform_pass", "not planned", _DIST),
    _p("run_gptq", "gptq_transform_pass", "different",
       "a graph pass: `{'config': <quantize config>, 'data': batches}`; the same quantized layers as "
       "quantize_transform_pass with GPTQ-rounded Linear weights (integer / scaled_integer / minifloat; "
       "mxint / block_fp / mxfp with each block's shared exponent fixed from its error-updated weights when the "
       "sweep reaches it; convs keep round-to-nearest)"),
    _p("rotate_llama", "rotate_hadamard_transform_pass", "different",
       "Hadamard rotations, outputs equal in fp32: `{'mode': 'rmsnorm'}` (Llama/Qwen: RMSNorm scales folded, the "
       "residual stream rotated in the weights), `'layernorm'` (pre-LN models such as GPT-2: the stream made "
       "mean-free, LayerNorms folded and replaced by unscaled RMSNorm, then rotated), `'online'` (any model, BERT "
       "too: W·H and x·H at run time for the linears `targets` selects; with a fused mode: QuaRot's down_proj "
       "rotation), `'auto'` picks a fused mode; QuaRot's per-head rotations are not done"),
    _p("rotate_qwen3", "rotate_hadamard_transform_pass", "different",
       "as rotate_llama (tested on Qwen2-style blocks; Qwen3's per-head q/k norms are left as they are)"),
    _p("fuse_rms_norms", "rotate_hadamard_transform_pass", "different",
       "folded into the following linears as the first step of the rotation pass (LayerNorm gamma and beta too, "
       "mode 'layernorm'), not a pass of its own"),
    _p("replace_rms_norms", "rotate_hadamard_transform_pass", "different",
       "the folded RMSNorm scales are set to 1 in place by the rotation pass; LayerNorms (mode 'layernorm') are "
       "replaced by nn.RMSNorm without a scale (exact: the stream is mean-free)"),
    # hardware and ONNX passes, removed from MASE's main by PR #307 (read at MASE_HARDWARE_COMMIT)
    _p("emit_verilog_top_transform_pass", "emit_verilog_transform_pass", "different",
       "one pass writes the top level, each layer and the weight ROMs (`out_dir`, `top`, `parallelism`)"),
    _p("emit_internal_rtl_transform_pass", "emit_verilog_transform_pass", "different",
       "the layers are written by emit_verilog_transform_pass from fxforge's own component library"),
    _p("emit_bram_transform_pass", "emit_verilog_transform_pass", "different",
       "weights are written by emit_verilog_transform_pass as ROM initialisation files"),
    _e("emit_cocotb_transform_pass", "fxforge.hardware.simulate.simulate_design", "different",
       "the cocotb testbench is built and run by simulate_design / `fxforge simulate-verilog`"),
    _e("run_cosim_analysis_pass", "fxforge.hardware.simulate.simulate_design", "different",
       "bit-exact simulation against the quantized model: simulate_design / `fxforge simulate-verilog`"),
    _p("add_hardware_metadata_analysis_pass", "hardware_estimate_analysis_pass", "different",
       "widths and parallelism are read from the quantization metadata at emission; this reports per layer "
       "multipliers, memory bits and latency", short="add_hardware_metadata"),
    _p("report_node_hardware_type_analysis_pass", "hardware_estimate_analysis_pass", "different",
       "per-layer hardware figures in the info", short="report_node_hardware_type"),
    _p("verify_hardware_metadata_analysis_pass", "emit_verilog_transform_pass", "not planned",
       "there is no hardware metadata to verify: what cannot be emitted is refused by the emitter, naming the "
       "node and the format", short="verify_hardware_metadata"),
    _p("emit_vivado_project_transform_pass", "emit_verilog_transform_pass", "not planned",
       "Vivado is proprietary and not installable here; fxforge's RTL is simulated with Verilator or Icarus"),
    _e("get_synthesis_results", "fxforge.hardware", "not planned",
       "needs Vivado synthesis; hardware_estimate_analysis_pass (issue #33) estimates resources instead"),
    _p("partition_to_multi_device_transform_pass", "split_stages_transform_pass", "different",
       "N pipeline stages cut where the profile / memory / parameters balance (`stages`, `balance`)"),
    _p("onnx_annotate_transform_pass", "fxforge.deploy.export_onnx", "not planned",
       "ONNX export is a deployment step, not a pass: fxforge.deploy.export_onnx / `fxforge deploy`",
       short="onnx_annotate"),
    _p("onnx_runtime_interface_pass", "fxforge.deploy.export_onnx", "not planned",
       "ONNX Runtime runs the deployed artifact: `fxforge deploy` exports, checks and times it",
       short="onnxruntime"),
    _e("export_fx_graph_analysis_pass", "fxforge.deploy.export_onnx", "not planned",
       "the captured graph is exported by fxforge.deploy (ONNX, AOTInductor, ExecuTorch)"),
    _p("ann2snn_transform_pass", "quantize_transform_pass", "not planned",
       "spiking-network conversion is outside fxforge's scope (no spiking modules)", short="ann2snn"),
    _p("ann2snn_module_transform_pass", "quantize_transform_pass", "not planned",
       "spiking-network conversion is outside fxforge's scope (no spiking modules)"),
    # pipelines
    _e("AutoPipeline", "fxforge.pipelines.Pipeline", "different",
       "steps are pass names (or functions) with args; each transform's numerical contract is checked"),
    _e("CompressionPipeline", "fxforge.pipelines.CompressionPipeline", "same",
       "pass_args keyed by pass name, run in the standard order"),
    _e("AutoPipelineForDistributedInference", "fxforge.pipelines.Pipeline", "not planned", _DIST),
    # actions
    _e("train", "fxforge.data.get_trainer", "different", "a HuggingFace Trainer on the captured graph"),
    _e("test", "fxforge.data.get_trainer", "different", "`get_trainer(...).evaluate()`"),
    _e("transform", "fxforge.pipelines.Pipeline.from_toml", "different",
       "a pipeline TOML (`fxforge run PIPELINE.toml MODEL -o DIR`); MASE's short names work as step names"),
    _e("search", "fxforge.search.search_from_config", "different", "Optuna studies; `fxforge search`"),
)


def _index() -> dict[str, MaseName]:
    out: dict[str, MaseName] = {}
    for row in MASE_NAMES:
        for key in (row.mase, row.short):
            if key and key in out:
                raise ValueError(f"MASE name {key!r} appears twice in the table")
            if key:
                out[key] = row
    return out


_BY_NAME = _index()


def lookup(name: str) -> MaseName | None:
    """The table's row for a MASE name (full or short), or None."""
    return _BY_NAME.get(name)


def target_exists(row: MaseName) -> bool:
    """Whether fxforge has what the row names: a registered pass, or an importable dotted path."""
    if "." not in row.fxforge:
        return row.fxforge in PASSES
    try:
        importlib.import_module(row.fxforge)  # a module itself
        return True
    except ImportError:
        pass
    module, _, attr = row.fxforge.rpartition(".")
    while module:
        try:
            obj: object = importlib.import_module(module)
        except ImportError:
            module, _, head = module.rpartition(".")
            attr = f"{head}.{attr}"
            continue
        for part in attr.split("."):
            obj = getattr(obj, part, None)
        return obj is not None
    return False


def _refusal(row: MaseName) -> str:
    where = f"{GUIDE}#{SECTION_NOT_PLANNED if row.status == 'not planned' else SECTION_NAMES}"
    if row.status == "planned":
        why = f"planned in issue #{row.issue} as {row.fxforge!r}, not registered yet"
    elif row.kind == "entry":
        why = f"it is not a pass in fxforge: use {row.fxforge}"
    else:
        why = f"{row.status}: {row.note}"
    closest = "" if row.status == "planned" else f"; closest in fxforge: {row.fxforge}"
    return f"MASE's {row.mase!r} has no fxforge pass ({why}){closest}; see {where}"


def mase_pass_name(name: str) -> str | None:
    """The registered fxforge pass MASE's ``name`` runs; None when ``name`` is not a MASE name.

    Raises :class:`MaseNameRefused` naming the closest fxforge pass and the guide's section when MASE has
    the name but fxforge has no pass for it (not planned, planned but not registered, or not a pass here).
    """
    row = lookup(name)
    if row is None:
        return None
    if row.kind == "pass" and row.status != "not planned" and row.fxforge in PASSES:
        return row.fxforge
    raise MaseNameRefused(_refusal(row))


def rows() -> list[dict[str, str]]:
    """The table as rows (MASE name, short key, fxforge name, status, note), status ``planned #N`` with
    ``(registered)`` once that pass exists."""
    out = []
    for r in MASE_NAMES:
        status = r.status if r.issue is None else f"planned #{r.issue}"
        if r.status == "planned" and r.kind == "pass" and r.fxforge in PASSES:
            status += " (registered)"
        out.append({"mase": r.mase, "short": r.short, "fxforge": r.fxforge, "status": status, "note": r.note})
    return out


def markdown() -> str:
    """The guide's two tables: every MASE name with its status, then the not-planned ones with the reason.

    Statuses are the table's own (a planned pass stays ``planned #N`` here until its row is changed), so the
    guide does not depend on which passes happen to be registered."""
    lines = [f"MASE names as of DeepWok/mase@{MASE_COMMIT[:12]}, and its hardware and ONNX passes as of "
             f"@{MASE_HARDWARE_COMMIT[:12]} (removed from its main since, still in its tutorials); `get_pass`, "
             "pipeline steps and `fxforge inspect --mase-names` read the same table (passes/mase_names.py).", "",
             "| MASE | short key | fxforge | status | notes |", "| --- | --- | --- | --- | --- |"]
    for r in MASE_NAMES:
        status = r.status if r.issue is None else f"planned #{r.issue}"
        note = "" if r.status == "not planned" else r.note
        short = f"`{r.short}`" if r.short else ""
        lines.append(f"| `{r.mase}` | {short} | `{r.fxforge}` | {status} | {note} |")
    lines += ["", f'<a id="{SECTION_NOT_PLANNED}"></a>', "", "### Not planned", "",
              "| MASE | closest in fxforge | why |", "| --- | --- | --- |"]
    lines += [f"| `{r.mase}` | `{r.fxforge}` | {r.note} |" for r in MASE_NAMES if r.status == "not planned"]
    return "\n".join(lines)


_BLOCK = re.compile(r"(<!-- mase-names:begin[^\n]*-->\n)(.*?)(\n<!-- mase-names:end -->)", re.S)


def guide_block(text: str) -> str | None:
    """The generated table as it stands in the guide's text (between its markers), or None."""
    found = _BLOCK.search(text)
    return found.group(2) if found else None


def sync_guide(path: str | Path) -> bool:
    """Rewrite the guide's generated block from the table (after changing a row); True when it changed.

    ``python -c "from fxforge.passes.mase_names import sync_guide; sync_guide('docs/migration.md')"``"""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if guide_block(text) is None:
        raise ValueError(f"{path} has no '<!-- mase-names:begin -->' ... '<!-- mase-names:end -->' block")
    new = _BLOCK.sub(lambda m: m.group(1) + markdown() + m.group(3), text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text
