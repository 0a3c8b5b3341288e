"""``fxforge inspect MODEL``: capture (or reload) a model and print what the IR holds.

Prints where the model came from, the frontend, node counts by kind and by op, parameters, the pass
history, which input dimensions accept any size and which capture fixed (with why), and capture notes,
then the per-node table (kind, op, shapes, dtypes) cut to the terminal width. A deploy directory (one with
``deploy.json``, written by ``fxforge deploy``) is shown instead: its artifact, signature and subprocess check.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

from .. import passes
from ..graph.forge_graph import ForgeGraph
from ..graph.metadata import has_meta
from ..graph.static_dims import input_dims
from ..passes.analysis.table import format_table, terminal_width

__all__ = ["deploy_summary", "dims_lines", "ensure_metadata", "mase_names_table", "summary"]


def ensure_metadata(mg: ForgeGraph) -> ForgeGraph:
    """Run the metadata passes unless every node already carries metadata (e.g. a reloaded checkpoint)."""
    if all(has_meta(n) for n in mg.nodes):
        return mg
    mg, _ = passes.init_metadata_analysis_pass(mg)
    if mg.example_inputs is not None:
        mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def dims_lines(mg: ForgeGraph, width: int) -> list[str]:
    """``dynamic dims:`` and ``static dims:`` lines from the graph's shape guard, reasons wrapped to ``width``."""
    dims = input_dims(mg.model)
    if not dims.guarded:
        why = "fx capture: torch.fx specialises no input size" if mg.frontend == "fx" else \
            "no shape guard in this graph: capture adds one whenever torch.export fixes a size or proves a range"
        return textwrap.wrap(f"dynamic dims: not checked ({why})", width, subsequent_indent=" " * 14)
    pad = " " * 14
    lines = textwrap.wrap("dynamic dims: " + (", ".join(dims.dynamic) or "none"), width, subsequent_indent=pad)
    if not dims.static:
        return [*lines, "static dims:  none"]
    for k, static in enumerate(dims.static):
        lines += textwrap.wrap(("static dims:  " if k == 0 else pad) + str(static), width, subsequent_indent=pad + "  ",
                               break_long_words=False, break_on_hyphens=False)
    return lines


def summary(mg: ForgeGraph, source: str, max_nodes: int | None = 40) -> str:
    """A few lines about the graph, then the node table (``max_nodes=None``: every node)."""
    history = ", ".join(p.name for p in mg.history) or "(none)"
    _, report = passes.report_graph_analysis_pass(mg, {"show": False})
    rows = report["rows"]
    kinds = Counter(r["kind"] for r in rows)
    ops = Counter(r["op"] for r in rows if r["kind"] not in ("placeholder", "output", "get_attr"))
    params = list(mg.model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    inputs = [n.name for n in mg.nodes if n.op == "placeholder"]
    width = terminal_width()
    lines = [
        f"model:      {source}",
        f"frontend:   {mg.frontend}; {len(rows)} nodes; inputs {inputs}",
        f"parameters: {total:,} ({trainable:,} trainable)",
        "kinds:      " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()),
        "top ops:    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)),
        f"passes:     {history}",
        *dims_lines(mg, width),
    ]
    lines += [f"note:       {note}" for note in mg.capture_notes]
    shown = rows if max_nodes is None else rows[:max_nodes]
    columns = ["node", "kind", "op", "in_shapes", "out_shapes", "out_dtype"]
    lines += ["", *format_table(shown, columns, max_width=width).splitlines()]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more nodes (--all shows every node)")
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in lines)


def deploy_summary(directory: Path) -> str:
    """The deploy directory's manifest and check (DeployError, one line, when ``deploy.json`` is malformed)."""
    from ..deploy import read_manifest
    from .deploy_view import manifest_lines

    return "\n".join(manifest_lines(read_manifest(directory), directory, terminal_width()))


def mase_names_table() -> str:
    """``--mase-names``: every MASE name, its fxforge name and status, from the table get_pass reads (complete
    rows: notes are not cut to the terminal)."""
    from ..passes import mase_names

    head = f"MASE names (DeepWok/mase@{mase_names.MASE_COMMIT[:12]}) -> fxforge; see {mase_names.GUIDE}"
    return head + "\n\n" + format_table(mase_names.rows(), ["mase", "short", "fxforge", "status", "note"])
