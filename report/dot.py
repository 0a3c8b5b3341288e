"""The report's module hierarchy as Graphviz DOT: open groups are nested clusters, closed ones single boxes.

``fxforge draw`` writes this (rendered by Graphviz's ``dot``: report/dot_render.py) so a drawing shows the same
grouping as the HTML report (report/hierarchy.py) instead of every node flat. ``depth`` picks which groups open:
None opens the report's default top level (``Hierarchy.expanded``), an int N the groups at most N levels below
the model (0: only the model itself, 1: each top-level module a cluster of its collapsed children), "all" every
group. ``overlay`` colours the boxes by one of the report's overlays (report/overlays.py) with the graph view's
colour ramp over the boxes drawn, and adds a legend. Node and cluster ids are generated (``n12``,
``cluster_3``); names only ever appear inside quoted strings, escaped by :func:`dot_string`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from .hierarchy import Hierarchy, ViewItem
from .overlays import OVERLAYS, Overlay

__all__ = ["ColourScale", "Depth", "dot_string", "find_overlay", "hierarchy_dot", "open_groups", "parse_depth"]

Depth = int | Literal["all"] | None
# The graph view's colours (report/graph_view_js.py): node kinds, module groups, the overlay ramp, "no value".
KIND = {"placeholder": "#c8e6c9", "get_attr": "#eeeeee", "module": "#bbdefb", "module_related_func": "#b3e5fc",
        "builtin_func": "#fff9c4", "output": "#ffcdd2"}
GROUP, CLUSTER, NA = "#e3eaf5", "#f4f7fb", "#f2f2f2"
RAMP = ("#fde725", "#5ec962", "#21918c", "#3b528b", "#440154")
MAX_LABEL = 48
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def dot_string(text: str) -> str:
    """``text`` as one DOT double-quoted string that Graphviz shows verbatim: backslashes doubled (no ``\\N``
    or ``\\l`` escapes survive), quotes escaped, line breaks as ``\\n``, other control characters dropped."""
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def parse_depth(text: str | None) -> Depth:
    """The ``--depth`` option: None (the report's top level), "all", or a level count >= 0 (ValueError else)."""
    if text is None or text.lower() in ("", "top", "default"):
        return None
    if text.lower() == "all":
        return "all"
    if not text.isdigit():
        raise ValueError(f"--depth must be a number of levels (0, 1, 2...), 'all' or 'top', got {text!r}")
    return int(text)


def _levels(h: Hierarchy) -> dict[str, int]:
    """Group id -> levels below the model's root group (root 0, a top-level module 1)."""
    out = {h.root: 0}
    stack = [h.root]
    while stack:
        gid = stack.pop()
        for c in h.items[gid].children:
            if h.items[c].kind == "group":
                out[c] = out[gid] + 1
                stack.append(c)
    return out


def open_groups(h: Hierarchy, depth: Depth = None) -> set[str]:
    """The groups drawn open (as clusters; the root is the drawing itself) at ``depth`` (see the module docstring)."""
    if depth is None:
        return set(h.expanded) | {h.root}
    levels = _levels(h)
    if depth == "all":
        return set(levels)
    return {g for g, level in levels.items() if level <= depth}


def _fmt(v: float) -> str:
    """A value as the graph view's legend prints it (4 significant digits, exponent when very large or small)."""
    a = abs(v)
    if a != 0 and (a >= 1e5 or a < 1e-2):
        return f"{v:.2e}"
    return f"{v:.4g}"


@dataclass(frozen=True)
class ColourScale:
    """The graph view's scale for one overlay over the values drawn: ``lo``..``hi`` (log when the overlay is)
    mapped on ``RAMP``; a box without a value is ``NA``."""

    overlay: Overlay
    values: tuple[float, ...]

    def _f(self, v: float) -> float:
        return math.log(max(v, 1e-12)) if self.overlay.log else v

    @property
    def lo(self) -> float:
        return min(self._f(v) for v in self.values)

    @property
    def hi(self) -> float:
        return max(self._f(v) for v in self.values)

    def colour(self, v: float | None) -> str:
        if v is None:
            return NA
        lo, hi = self.lo, self.hi
        t = (self._f(v) - lo) / (hi - lo) if hi > lo else 0.5
        k = min(3.999, max(0.0, t) * 4)
        i = int(k)
        return _mix(RAMP[i], RAMP[i + 1], k - i)

    def legend(self) -> list[tuple[str, str]]:
        """(colour, text) swatches: each value when at most 8 distinct, else the ramp's five stops; then n/a."""
        distinct = sorted(set(self.values))
        if len(distinct) <= 8:
            rows = [(self.colour(v), _fmt(v)) for v in distinct]
        else:
            inv = math.exp if self.overlay.log else (lambda u: u)
            rows = [(c, _fmt(inv(self.lo + (self.hi - self.lo) * k / 4))) for k, c in enumerate(RAMP)]
        return [*rows, (NA, "n/a")]


def _mix(a: str, b: str, t: float) -> str:
    ca = [int(a[1 + 2 * i:3 + 2 * i], 16) for i in range(3)]
    cb = [int(b[1 + 2 * i:3 + 2 * i], 16) for i in range(3)]
    return "#" + "".join(f"{round(x * (1 - t) + y * t):02x}" for x, y in zip(ca, cb, strict=True))


def _ink(fill: str) -> str:
    """Black or white text, whichever reads on ``fill`` (the graph view's rule)."""
    r, g, b = (int(fill[1 + 2 * i:3 + 2 * i], 16) for i in range(3))
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#111111"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


def _box_label(item: ViewItem, overlay: Overlay | None) -> str:
    if item.kind == "group":
        lines = [item.label, f"{item.info.get('module') or 'module'} ({item.info.get('nodes', '?')} nodes)"]
    else:
        lines = [item.label, item.info.get("op", "")]
        if item.info.get("shape"):
            lines.append(item.info["shape"])
    if overlay is not None and overlay.key in item.values:
        lines.append(f"{overlay.key}: {_fmt(item.values[overlay.key])}")
    return "\n".join(_clip(line) for line in lines if line)


def find_overlay(name: str) -> Overlay:
    """The overlay called ``name`` (its key, e.g. ``bits``, ``sensitivity``); ValueError naming them all."""
    for o in OVERLAYS:
        if name == o.key:
            return o
    raise ValueError(f"unknown overlay {name!r}; overlays: {', '.join(o.key for o in OVERLAYS)}")


def hierarchy_dot(h: Hierarchy, depth: Depth = None, overlay: str | None = None, title: str = "fxforge graph") -> str:
    """The DOT text of ``h`` with the groups of ``depth`` open, boxes coloured by ``overlay`` (a key of
    ``OVERLAYS``; ValueError when unknown or when no box drawn has a value for it) plus its legend."""
    opened = open_groups(h, depth)
    ov = find_overlay(overlay) if overlay is not None else None
    ids: dict[str, str] = {}
    rep: dict[str, str] = {}  # item id -> the box that stands for it (itself, or its closed ancestor group)
    boxes: list[str] = []

    def assign(item_id: str, box: str | None) -> None:
        item = h.items[item_id]
        if box is None and not (item.kind == "group" and item_id in opened):
            box = item_id
            boxes.append(item_id)
        if box is not None:
            rep[item_id] = box
        for c in item.children:
            assign(c, box)

    assign(h.root, None)
    scale = None
    if ov is not None:
        values = tuple(h.items[b].values[ov.key] for b in boxes if ov.key in h.items[b].values)
        if not values:
            raise ValueError(f"overlay {ov.key!r}: no box drawn has a value (the graph's metadata holds none for "
                             f"it; {_WHY.get(ov.key, 'run the analysis pass that records it')})")
        scale = ColourScale(ov, values)
    for k, b in enumerate(boxes):
        ids[b] = f"n{k}"
    lines = [f"digraph {dot_string(title)} {{",
             '  graph [charset="UTF-8", rankdir=TB, compound=true, fontname="Helvetica", nodesep=0.25, ranksep=0.35,'
             f" label={dot_string(title)}, labelloc=t];",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#777777", arrowsize=0.6];']
    cluster_no = [0]

    def emit(gid: str, indent: str) -> None:
        for c in h.items[gid].children:
            item = h.items[c]
            if c in ids:
                if scale is not None:
                    fill = scale.colour(item.values.get(scale.overlay.key))
                else:
                    fill = GROUP if item.kind == "group" else KIND.get(item.info.get("kind", ""), "#ffffff")
                shape = ', penwidth=2' if item.kind == "group" else ""
                lines.append(f"{indent}{ids[c]} [id={dot_string(c)}, label={dot_string(_box_label(item, ov))}, "
                             f'tooltip={dot_string(item.path or item.label)}, fillcolor="{fill}", '
                             f'fontcolor="{_ink(fill)}"{shape}];')
            elif item.kind == "group":
                cluster_no[0] += 1
                head = f"{item.label}  ({item.info.get('module') or 'module'})"
                lines.append(f"{indent}subgraph cluster_{cluster_no[0]} {{")
                lines.append(f"{indent}  id={dot_string(c)}; label={dot_string(_clip(head))}; "
                             f"tooltip={dot_string(item.path or item.label)};")
                lines.append(f'{indent}  style="rounded,filled"; fillcolor="{CLUSTER}"; color="#8aa4c8"; '
                             "fontsize=11; labeljust=l;")
                emit(c, indent + "  ")
                lines.append(f"{indent}}}")

    emit(h.root, "  ")
    seen: set[tuple[str, str]] = set()
    for s, d in h.edges:
        src, dst = rep.get(s), rep.get(d)
        if src is None or dst is None or src == dst or (src, dst) in seen:
            continue
        seen.add((src, dst))
        lines.append(f"  {ids[src]} -> {ids[dst]};")
    if scale is not None:
        lines.extend(_legend(scale))
    lines.append("}")
    return "\n".join(lines) + "\n"


_WHY = {"sensitivity": "give sensitivity data: fxforge draw/report --sensitivity-data N",
        "latency_ms": "run profile_analysis_pass", "flops": "run profile_analysis_pass",
        "memory": "run liveness_analysis_pass", "sqnr_db": "only quantized graphs have it"}


def _legend(scale: ColourScale) -> list[str]:
    """A legend cluster: the overlay's title and unit, then one swatch box per legend row, in a column."""
    o = scale.overlay
    title = o.title + (f" ({o.unit})" if o.unit else "") + (" (log scale)" if o.log else "")
    out = ["  subgraph cluster_legend {",
           f'    id="legend"; label={dot_string(title)}; style="rounded"; color="#999999"; fontsize=11;']
    prev = None
    for k, (colour, text) in enumerate(scale.legend()):
        out.append(f'    legend{k} [label={dot_string(text)}, fillcolor="{colour}", fontcolor="{_ink(colour)}", '
                   "width=1.2, height=0.3];")
        if prev is not None:
            out.append(f"    {prev} -> legend{k} [style=invis];")
        prev = f"legend{k}"
    out.append("  }")
    return out
