"""The before / after page (``fxforge report A B``): both graphs side by side, changed layers highlighted, a
summary of parameters, weight bits, bytes on disk, latency and accuracy, and the table of changed layers.

One self-contained offline HTML file like the single report; each side is the report's hierarchical graph view
(report/graph_view.py). Highlighting is generated CSS on the view's boxes (``g.fxg-box[data-id=...]``): the
changed nodes and, dashed, the module groups holding them, so the collapsed top level shows where changes are;
it survives the view's redraws. Every name is escaped for its context (HTML text, CSS string).
"""

from __future__ import annotations

import datetime as _dt
from html import escape
from pathlib import Path

from ..graph.forge_graph import ForgeGraph
from .compare_data import Comparison, LayerChange, SideSummary, compare_graphs
from .graph_view import graph_view_html
from .hierarchy import Hierarchy, build_hierarchy
from .plots import format_bytes

__all__ = ["comparison_html", "compare_graphs", "write_comparison"]

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}.sub{color:#666}section{margin:1.4em 0}
table{border-collapse:collapse;font-size:12px}th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;
vertical-align:top}th{background:#f3f3f3}.sides{display:flex;gap:12px}.side{flex:1;min-width:0}
.tag{display:inline-block;background:#fde0dc;
border-radius:3px;padding:0 4px;margin:1px}.better{color:#1b5e20}.worse{color:#b71c1c}#js-errors{color:#b00}
.legend span{display:inline-block;width:14px;height:10px;border:3px solid #d32f2f;margin-right:4px}
.legend span.group{border-style:dashed}
"""

JS = r"""
(function(){
  var errors = document.getElementById('js-errors');
  window.addEventListener('error', function(e){ errors.textContent += (e.message || 'error') + '\n'; });
  var views = document.querySelectorAll('.side .fxg');
  function find(path){  // the graph views' own search: opens the groups holding a match and outlines it
    views.forEach(function(v){ var box = v.querySelector('input.fxg-search'); box.value = path;
      box.dispatchEvent(new Event('input')); });
  }
  document.querySelectorAll('a.layer-link').forEach(function(a){
    a.addEventListener('click', function(ev){ ev.preventDefault(); find(a.getAttribute('data-path')); });
  });
  document.body.setAttribute('data-ready', '1');
})();
"""


def _css_string(text: str) -> str:
    """``text`` as a CSS string literal: every character but [A-Za-z0-9_-] as a CSS hex escape."""
    return '"' + "".join(c if c.isascii() and (c.isalnum() or c in "_-") else f"\\{ord(c):06x}" for c in text) + '"'


def _highlight_css(view_id: str, h: Hierarchy, names: set[str]) -> str:
    """Red outlines for the changed nodes' boxes of view ``view_id`` and dashed ones for every module group that
    holds one (open as a frame or closed as a box), so a collapsed view still shows where the changes are."""
    nodes = sorted(f"n:{n}" for n in names if f"n:{n}" in h.items)
    groups: set[str] = set()
    for item_id in nodes:
        parent = h.items[item_id].parent
        while parent is not None and parent != h.root:
            groups.add(parent)
            parent = h.items[parent].parent
    vid = f"#{view_id}"
    node_rules = ",".join(f"{vid} g.fxg-box[data-id={_css_string(i)}]>rect" for i in nodes)
    group_rules = ",".join(f"{vid} g.fxg-box[data-id={_css_string(i)}]>rect,"
                           f"{vid} g.fxg-frame[data-id={_css_string(i)}]>rect:first-child" for i in sorted(groups))
    return ((f"{node_rules}{{stroke:#d32f2f;stroke-width:4px}}" if node_rules else "")
            + (f"{group_rules}{{stroke:#d32f2f;stroke-width:3px;stroke-dasharray:6 3}}" if group_rules else ""))


def _fmt(value: float | int | None, kind: str) -> str:
    if value is None:
        return "unknown"
    if kind == "bytes":
        return f"{format_bytes(value)} ({int(value):,} B)"
    if kind == "bits":
        return f"{format_bytes(value / 8)} ({int(value):,} bits)"
    if kind == "ms":
        return f"{value:.3f} ms"
    if kind == "acc":
        return f"{value:.4f}"
    return f"{int(value):,}"


ROWS: tuple[tuple[str, str, str, bool], ...] = (  # label, SideSummary field, format, lower is better
    ("nodes", "nodes", "count", True), ("parameters", "parameters", "count", True),
    ("non-zero parameters", "nonzero_parameters", "count", True), ("weight bits", "weight_bits", "bits", True),
    ("weights on disk", "bytes_on_disk", "bytes", True), ("latency (profiled nodes, sum)", "latency_ms", "ms", True),
    ("accuracy", "accuracy", "acc", False))


def _summary(a: SideSummary, b: SideSummary) -> str:
    rows = []
    for label, attr, kind, lower in ROWS:
        va, vb = getattr(a, attr), getattr(b, attr)
        ratio, cls = "", ""
        if va is not None and vb is not None and va:
            ratio = f"{vb / va:.3g}x"
            cls = "" if vb == va else ("better" if (vb < va) == lower else "worse")
        rows.append(f"<tr class='summary-row' data-metric='{escape(attr)}'><td>{escape(label)}</td>"
                    f"<td>{escape(_fmt(va, kind))}</td><td>{escape(_fmt(vb, kind))}</td>"
                    f"<td class='{cls}'>{escape(ratio)}</td></tr>")
    return (f"<table id='summary'><thead><tr><th></th><th>{escape(a.name)}</th><th>{escape(b.name)}</th>"
            "<th>after / before</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _changes(layers: tuple[LayerChange, ...]) -> str:
    if not layers:
        return "<p id='no-changes'>No layer differs.</p>"
    rows = []
    for c in layers:
        tags = "".join(f"<span class='tag'>{escape(t)}</span>" for t in c.tags)
        rows.append(f"<tr class='layer-row' data-path='{escape(c.path)}'><td><a href='#' class='layer-link' "
                    f"data-path='{escape(c.path)}'>{escape(c.path)}</a></td><td>{escape(', '.join(c.kinds))}</td>"
                    f"<td>{tags}</td><td>{escape(c.detail[:300])}</td></tr>")
    return ("<table id='changes'><thead><tr><th>layer</th><th>what differs</th><th>what the passes did</th>"
            "<th>detail</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _side(key: str, s: SideSummary, mg: ForgeGraph, changed: set[str]) -> tuple[str, str]:
    """(HTML, CSS) of one side: the report's hierarchical graph view (report/graph_view.py), its changes outlined."""
    h = build_hierarchy(mg)
    vid = f"side-{key}-graph"
    html = (f"<div class='side side-{key}'><h3>{escape(s.name)}</h3><p class='sub'>{s.nodes} nodes; passes: "
            f"{escape(', '.join(s.passes) or 'none')}</p>{graph_view_html(h, vid)}</div>")
    return html, _highlight_css(vid, h, changed)


def comparison_html(comparison: Comparison, title: str = "fxforge before / after") -> str:
    """The before / after page of ``comparison`` as one HTML document (it must carry its graphs)."""
    if comparison.graphs is None:
        raise ValueError("this comparison carries no graphs to draw: build it with compare_graphs(a, b)")
    a, b = comparison.a, comparison.b
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    side_a = _side("a", a, comparison.graphs[0], {n for c in comparison.layers for n in c.nodes_a})
    side_b = _side("b", b, comparison.graphs[1], {n for c in comparison.layers for n in c.nodes_b})
    sides, highlight = side_a[0] + side_b[0], side_a[1] + side_b[1]
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
        f"<style>{CSS}{highlight}</style></head><body>",
        f"<h1>{escape(title)}</h1><p class='sub'>{escape(a.name)} → {escape(b.name)}; generated {stamp} by fxforge</p>",
        '<pre id="js-errors"></pre>',
        "<section><h2>Summary</h2>" + _summary(a, b) + "</section>",
        f"<section><h2>Changed layers ({len(comparison.layers)})</h2><p class='sub legend'><span></span>changed "
        "layers are outlined in red in both graphs, <span class='group'></span>the modules holding them dashed; "
        "click a layer to find it.</p>"
        + _changes(comparison.layers) + "</section>",
        f"<section><h2>Graphs</h2><div class='sides'>{sides}</div></section>",
        f"<script>{JS}</script></body></html>",
    ]) + "\n"


def write_comparison(comparison: Comparison, path: str | Path, title: str = "fxforge before / after") -> Path:
    """Write :func:`comparison_html` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(comparison_html(comparison, title), encoding="utf-8")
    return path
