"""report_node_{type,shape,meta_param}_analysis_pass: MASE's three per-node metadata reports.

The content is MASE's: a type table (node, fx op, MASE type, MASE op, value type of the first input), a
shape listing (each node's ``in:`` entries with their shapes, or values for non-tensors, and ``out:``
results), and a metadata table (node, fx op, MASE type, MASE op, then the common / software / hardware
sections as JSON). Each prints when ``show`` is set, writes its text to ``file`` when given, and returns it
with structured rows in a typed info.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import ValueMeta, get_meta
from ..base import forge_pass
from ..contract import PassInfo
from .table import format_table, terminal_width

__all__ = ["NodeMetaParamArgs", "ReportArgs", "ReportNodeInfo", "ReportNodeShapeInfo",
           "report_node_meta_param_analysis_pass", "report_node_shape_analysis_pass",
           "report_node_type_analysis_pass"]

SECTIONS = ("common", "software", "hardware")


@dataclass(frozen=True)
class ReportArgs:
    """show: print the report; file: also write it there."""

    show: bool = True
    file: str | None = None
    MASE_ALIASES: ClassVar[dict[str, str]] = {"file_name": "file", "save_path": "file"}
    OUTPUT_PATHS: ClassVar[tuple[str, ...]] = ("file",)


@dataclass(frozen=True)
class NodeMetaParamArgs(ReportArgs):
    """which: sections to show, any of "all", "common", "software", "hardware" (MASE: "which"; a single
    string is accepted); show / file (MASE: save_path) as for every report."""

    which: tuple[str, ...] | str = ("all",)

    def __post_init__(self) -> None:
        which = (self.which,) if isinstance(self.which, str) else self.which
        bad = [w for w in which if w not in ("all", *SECTIONS)]
        if bad or not which:
            raise ValueError(f"which={self.which!r}: pick from ['all', 'common', 'software', 'hardware']")
        object.__setattr__(self, "which", SECTIONS if "all" in which else tuple(w for w in SECTIONS if w in which))


@dataclass(frozen=True)
class ReportNodeInfo(PassInfo):
    """text: the report as printed; rows: one dict per node."""

    text: str
    rows: tuple[dict[str, Any], ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class ReportNodeShapeInfo(ReportNodeInfo):
    """shapes[node] = {"in": {entry: shape or value}, "out": {entry: shape}} as listed in ``text``."""

    shapes: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


def _emit(text: str, args: ReportArgs, rows_for_terminal: list[dict[str, Any]] | None = None) -> None:
    if args.show:
        print(format_table(rows_for_terminal, max_width=terminal_width()) if rows_for_terminal else text)
    if args.file is not None:
        path = Path(args.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")


def _identity(node: fx.Node) -> dict[str, Any]:
    common = get_meta(node).common
    return {"node": node.name, "fx_op": node.op, "mase_type": common.kind.value, "mase_op": common.op}


def _value_type(node: fx.Node) -> str:
    """The first input's type: its quantization format when quantized (MASE's "fixed"...), else its dtype."""
    meta = get_meta(node)
    quantized = meta.software.to_json().get("software.quantization", {})
    if quantized.get("format"):
        return str(quantized["format"])
    first = meta.common.args.get("data_in_0")
    if first is None:
        return "NA"
    return first.dtype if first.type == "tensor" and first.dtype else first.type


@forge_pass("analysis", ReportArgs, info=ReportNodeInfo, requires=("metadata",))
def report_node_type_analysis_pass(graph: ForgeGraph, args: ReportArgs) -> tuple[ForgeGraph, ReportNodeInfo]:
    """Tabulate each node's fx op, MASE type and op and the value type of its first input."""
    rows = [{**_identity(n), "value_type": _value_type(n)} for n in graph.model.graph.nodes]
    text = format_table(rows)
    _emit(text, args, rows)
    return graph, ReportNodeInfo(text=text, rows=tuple(rows))


def _shown(value: ValueMeta) -> Any:
    return list(value.shape or ()) if value.type == "tensor" else value.value


@forge_pass("analysis", ReportArgs, info=ReportNodeShapeInfo, requires=("metadata",))
def report_node_shape_analysis_pass(graph: ForgeGraph, args: ReportArgs) -> tuple[ForgeGraph, ReportNodeShapeInfo]:
    """List each node's inputs (shapes, or values for non-tensors) and results (shapes), MASE's layout."""
    shapes: dict[str, dict[str, dict[str, Any]]] = {}
    blocks = []
    for node in graph.model.graph.nodes:
        common = get_meta(node).common
        entry = {"in": {k: _shown(v) for k, v in common.args.items()},
                 "out": {k: _shown(v) for k, v in common.results.items()}}
        shapes[node.name] = entry
        lines = [f"{node.name}:", "in:", *(f"{k} = {v}" for k, v in entry["in"].items()),
                 "out:", *(f"{k} = {v}" for k, v in entry["out"].items())]
        blocks.append("\n".join(lines))
    text = "\n\n".join(blocks)
    _emit(text, args)
    rows = tuple({"node": n, "in": s["in"], "out": s["out"]} for n, s in shapes.items())
    return graph, ReportNodeShapeInfo(text=text, rows=rows, shapes=shapes)


@forge_pass("analysis", NodeMetaParamArgs, info=ReportNodeInfo, requires=("metadata",))
def report_node_meta_param_analysis_pass(graph: ForgeGraph,
                                         args: NodeMetaParamArgs) -> tuple[ForgeGraph, ReportNodeInfo]:
    """Tabulate each node's identity and the chosen metadata sections (JSON) for every node."""
    rows, cells = [], []
    for node in graph.model.graph.nodes:
        data = get_meta(node).to_json()
        rows.append({**_identity(node), **{s: data[s] for s in args.which}})
        cells.append({**_identity(node), **{s: json.dumps(data[s], sort_keys=True) for s in args.which}})
    text = format_table(cells)
    _emit(text, args, cells)
    return graph, ReportNodeInfo(text=text, rows=tuple(rows))
