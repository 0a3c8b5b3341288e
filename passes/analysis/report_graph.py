"""report_graph_analysis_pass: a table of every node with its kind, op, shapes and dtypes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.metadata import ValueMeta, get_meta, has_meta
from ..base import forge_pass
from ..contract import PassInfo
from .table import format_table, terminal_width


@dataclass(frozen=True)
class ReportGraphArgs:
    """file: also write the table there; show: print it."""

    file: str | None = None
    show: bool = True
    MASE_ALIASES: ClassVar[dict[str, str]] = {"file_name": "file"}
    OUTPUT_PATHS: ClassVar[tuple[str, ...]] = ("file",)  # written to: kept under the output root when a file names it


def _describe(values: dict[str, ValueMeta]) -> tuple[str, str]:
    tensors = [v for v in values.values() if v.type == "tensor"]
    shapes = " ".join(str(list(v.shape or ())) for v in tensors)
    dtypes = " ".join(sorted({v.dtype or "" for v in tensors}))
    return shapes, dtypes


@dataclass(frozen=True)
class ReportGraphInfo(PassInfo):
    """table: the rendered table; rows: one dict of strings per node."""

    table: str
    rows: list[dict[str, str]] = field(default_factory=list)


@forge_pass("analysis", ReportGraphArgs, info=ReportGraphInfo)
def report_graph_analysis_pass(graph: ForgeGraph, args: ReportGraphArgs) -> tuple[ForgeGraph, ReportGraphInfo]:
    """Tabulate node, kind, op, target, input/output shapes and output dtypes (shapes need metadata)."""
    rows: list[dict[str, str]] = []
    for node in graph.model.graph.nodes:
        if has_meta(node):
            common = get_meta(node).common
            kind, op = common.kind, common.op
            in_shapes, _ = _describe({k: v for k, v in common.args.items() if k.startswith("data_in")})
            out_shapes, out_dtypes = _describe(common.results)
        else:
            kind, op = classify(node, graph.model)
            in_shapes = out_shapes = out_dtypes = "-"
        rows.append({
            "node": node.name, "kind": kind.value, "op": op, "target": str(node.target)[:48],
            "in_shapes": in_shapes, "out_shapes": out_shapes, "out_dtype": out_dtypes,
        })
    table = format_table(rows)
    if args.show:  # printed to fit the terminal; the returned and written tables are complete
        print(format_table(rows, max_width=terminal_width()))
    if args.file is not None:
        Path(args.file).write_text(table + "\n", encoding="utf-8")
    return graph, ReportGraphInfo(table=table, rows=rows)
