"""A dependency-free SVG picture of a ForgeGraph (no graphviz needed).

Layered layout: a node's row is the longest path from the inputs (constants and parameters sit just
above their first user), rows are ordered by the mean position of each node's inputs, and boxes are
coloured by MASE node kind and labelled with name, canonical op and, when metadata is present, the
output shape. Wide graphs give wide pictures; that keeps a ~500-node BERT readable when zoomed.
``mg.draw`` and ``fxforge draw --flat`` write it; ``fxforge draw``'s default, the report's module hierarchy as
Graphviz clusters, is report/dot.py's (it needs the report's grouping, which graph/ cannot import).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape, quoteattr

import torch.fx as fx
import torch.nn as nn

from .ir import classify
from .metadata import get_meta, has_meta

if TYPE_CHECKING:
    from .forge_graph import ForgeGraph

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 220, 50, 24, 46, 20
MAX_CHARS = 32
COLOURS = {
    "placeholder": "#c8e6c9", "get_attr": "#eeeeee", "module": "#bbdefb", "module_related_func": "#b3e5fc",
    "builtin_func": "#fff9c4", "output": "#ffcdd2",
}


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def _describe(node: fx.Node, root: nn.Module) -> tuple[str, str, str]:
    """(kind, canonical op, output shape text) of a node, tolerant of odd targets."""
    try:
        kind, op = classify(node, root)
        kind_name = kind.value
    except Exception:  # noqa: BLE001 - drawing must not fail on an unusual node
        kind_name, op = node.op, str(node.target)
    shape = ""
    if has_meta(node):
        out = get_meta(node).common.results.get("data_out_0")
        if out is not None and out.type == "tensor":
            shape = f"{list(out.shape or ())} {out.dtype}"
        elif out is not None:
            shape = out.type
    return kind_name, op, shape


def layout(graph: fx.Graph) -> dict[fx.Node, tuple[float, int]]:
    """node → (x, row): longest-path rows, barycentre ordering, no overlapping boxes."""
    nodes = list(graph.nodes)
    row: dict[fx.Node, int] = {}
    for n in nodes:  # graph order is topological
        row[n] = 1 + max((row[p] for p in n.all_input_nodes), default=-1)
    for n in reversed(nodes):  # inputs-free non-placeholders sit right above their first user
        if not n.all_input_nodes and n.op != "placeholder" and n.users:
            row[n] = max(0, min(row[u] for u in n.users) - 1)
    rows: dict[int, list[fx.Node]] = {}
    for n in nodes:
        rows.setdefault(row[n], []).append(n)
    pos: dict[fx.Node, tuple[float, int]] = {}
    for r in sorted(rows):
        order = {n: i for i, n in enumerate(rows[r])}
        wanted = {}
        for n in rows[r]:
            xs = [pos[p][0] for p in n.all_input_nodes if p in pos]
            wanted[n] = sum(xs) / len(xs) if xs else order[n] * (BOX_W + GAP_X)
        x_prev = -float("inf")
        for n in sorted(rows[r], key=lambda m: (wanted[m], order[m])):
            x = max(wanted[n], x_prev + BOX_W + GAP_X)
            pos[n] = (x, r)
            x_prev = x
    shift = -min((x for x, _ in pos.values()), default=0.0)
    return {n: (x + shift, r) for n, (x, r) in pos.items()}


def to_svg(mg: ForgeGraph) -> str:
    """The SVG document of ``mg``'s graph as a string."""
    graph, root = mg.model.graph, mg.model
    pos = layout(graph)
    width = int(max((x for x, _ in pos.values()), default=0) + BOX_W + 2 * MARGIN)
    height = int((max((r for _, r in pos.values()), default=0) + 1) * (BOX_H + GAP_Y) + 2 * MARGIN)

    def xy(n: fx.Node) -> tuple[float, float]:
        x, r = pos[n]
        return x + MARGIN, r * (BOX_H + GAP_Y) + MARGIN

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        '<g class="edges" fill="none" stroke="#777" stroke-width="1">',
    ]
    for n in graph.nodes:
        x2, y2 = xy(n)
        for p in n.all_input_nodes:
            x1, y1 = xy(p)
            x1, y1, x2c = x1 + BOX_W / 2, y1 + BOX_H, x2 + BOX_W / 2
            dy = max(GAP_Y / 2, (y2 - y1) / 3)
            out.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + dy:.1f} {x2c:.1f},{y2 - dy:.1f} '
                       f'{x2c:.1f},{y2:.1f}" marker-end="url(#arrow)"/>')
    out.append("</g>")
    for n in graph.nodes:
        x, y = xy(n)
        kind, op, shape = _describe(n, root)
        title = f"{n.name}\n{n.op}: {n.target}\nop: {op}" + (f"\nout: {shape}" if shape else "")
        out.append(f'<g class="node" data-name={quoteattr(n.name)}><title>{escape(title)}</title>')
        out.append(f'<rect class="node-box" x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="6" '
                   f'fill="{COLOURS.get(kind, "#ffffff")}" stroke="#333"/>')
        for i, (text, weight) in enumerate(((n.name, "bold"), (op, "normal"), (shape, "normal"))):
            if text:
                out.append(f'<text x="{x + 8:.1f}" y="{y + 15 + 14 * i:.1f}" font-weight="{weight}">'
                           f"{escape(_clip(text))}</text>")
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def draw_svg(mg: ForgeGraph, path: str | Path) -> Path:
    """Write the SVG picture of ``mg``'s graph to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_svg(mg), encoding="utf-8")
    return path
