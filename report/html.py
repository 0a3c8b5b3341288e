"""Assemble the self-contained HTML report: the hierarchical graph view, sortable tables, PNG plots, no network.

Everything is in one file (CSS, the view's script, its JSON, base64 PNGs), so it opens offline and can be
mailed. The graph is report/graph_view.py's view (modules collapsible, overlays from metadata); the table has
one row per module (report/module_table.py). The inline script sorts a table when its header is clicked and
writes any JavaScript error into ``#js-errors`` (a headless browser test reads that element); ``#selftest`` in
the URL sorts the module table by node count and records whether the result is ordered in ``#selftest``.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ..graph.forge_graph import ForgeGraph
from .deploy import DeployArtifactRow, deploy_section
from .graph_view import graph_view_html
from .hierarchy import build_hierarchy
from .memory_timeline import memory_timeline
from .module_table import module_table
from .plots import format_bytes, memory_timeline_svg, plots_available, search_plots
from .rows import QuantRow, quant_rows
from .search_json import check_search_results

__all__ = ["build_report", "write_report"]

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}h1{margin-bottom:.2em}
.sub{color:#666}section{margin:1.6em 0}table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;position:sticky;top:0}th.sorted-asc:after{content:" ▲"}
th.sorted-desc:after{content:" ▼"}tr:nth-child(even) td{background:#fafafa}
.drawing{overflow:auto;max-height:70vh;border:1px solid #ccc}.cards span{display:inline-block;
margin:0 1.2em .4em 0}.cards b{font-size:1.3em}#js-errors{color:#b00}img{max-width:100%}
"""

JS = r"""
(function(){
  var errors = document.getElementById('js-errors');
  window.addEventListener('error', function(e){ errors.textContent += (e.message || 'error') + '\n'; });
  function key(td){ var t = td.getAttribute('data-sort') || td.textContent.trim(); var n = parseFloat(t);
    return (t !== '' && !isNaN(n) && isFinite(t)) ? [0, n] : [1, t.toLowerCase()]; }
  function cmp(a, b){ if (a[0] !== b[0]) return a[0] - b[0]; return a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0; }
  function sortTable(table, col, desc){
    var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
    rows.sort(function(r1, r2){ var c = cmp(key(r1.cells[col]), key(r2.cells[col])); return desc ? -c : c; });
    rows.forEach(function(r){ body.appendChild(r); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function(th, i){
      th.classList.remove('sorted-asc', 'sorted-desc');
      if (i === col) th.classList.add(desc ? 'sorted-desc' : 'sorted-asc'); });
  }
  document.querySelectorAll('table.sortable').forEach(function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function(th, i){
      th.addEventListener('click', function(){ sortTable(table, i, th.classList.contains('sorted-asc')); });
    });
  });
  if (location.hash === '#selftest') {
    var table = document.getElementById('modules'), col = 2;
    sortTable(table, col, false);
    var keys = Array.prototype.map.call(table.tBodies[0].rows, function(r){ return key(r.cells[col]); });
    var ok = keys.every(function(k, i){ return i === 0 || cmp(keys[i - 1], k) <= 0; });
    document.getElementById('selftest').textContent = ok ? 'sorted-ok' : 'sorted-wrong';
  }
  document.body.setAttribute('data-ready', '1');
})();
"""

def _table(table_id: str, header: tuple[str, ...] | list[str], rows: list[list[str]], row_class: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "\n".join(f'<tr class="{row_class}">' + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
                     for r in rows)
    return f'<table id="{table_id}" class="sortable"><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def _history(mg: ForgeGraph) -> str:
    if not mg.history:
        return "<p>No passes recorded.</p>"
    rows = [[str(i + 1), p.name, p.kind, json.dumps(p.args, sort_keys=True, default=str)[:300]]
            for i, p in enumerate(mg.history)]
    return _table("history", ["#", "pass", "kind", "args"], rows, "history-row")


def _quantization(rows: list[QuantRow], note: str) -> str:
    if not rows:
        return "<p>No quantized nodes.</p>"
    roles = sorted({r for q in rows for r in q.bits})
    cells = [[q.name, q.op, q.format, *(str(q.bits.get(r, "")) for r in roles),
              "" if q.sqnr_db is None else f"{q.sqnr_db:.2f}"] for q in rows]
    header = ["node", "op", "format", *(f"{r} bits" for r in roles), "SQNR dB"]
    return f"<p class='sub'>{escape(note)}</p>" + _table("quantization", header, cells, "quant-row")


def _memory(mg: ForgeGraph) -> str:
    """The memory timeline (live bytes per node) and the largest buffers at each peak, when liveness ran."""
    try:
        tl = memory_timeline(mg)
    except ValueError as exc:
        return f"<p>Memory timeline not shown: {escape(str(exc))}</p>"
    if tl is None:
        return "<p>No liveness metadata (run <code>liveness_analysis_pass</code> before the report).</p>"
    rows = [[peak, b.node, format_bytes(b.bytes), str(b.bytes), str(b.born), str(b.dies), "yes" if b.saved else ""]
            for peak, at in (("training", tl.at_training_peak), ("inference", tl.at_inference_peak)) for b in at]
    header = ["peak", "created by", "size", "bytes", "born", "dies", "saved for backward"]
    return (f"<p>Estimated activation peaks: training <b>{escape(format_bytes(tl.peak_training_bytes))}</b> at "
            f"<code>{escape(tl.nodes[tl.peak_training])}</code>, inference "
            f"<b>{escape(format_bytes(tl.peak_inference_bytes))}</b> at <code>{escape(tl.nodes[tl.peak_inference])}"
            "</code> (parameters and inputs not counted).</p>"
            f"<div class='drawing'>{memory_timeline_svg(tl)}</div><h3>Largest buffers alive at each peak</h3>"
            + _table("memory-peak", header, rows, "memory-row"))


def _search(results: Mapping[str, Any] | None) -> str:
    if results is None:
        return "<p>No search results given (<code>fxforge report CKPT --search results.json</code>).</p>"
    objectives = [str(o) for o in results.get("objectives", [])]
    rows = [[str(r.get("trial", "")), *(str(r.get(o, "")) for o in objectives), str(r.get("feasible", "")),
             json.dumps(r.get("params", {}), sort_keys=True)[:200]] for r in results.get("front", [])]
    parts = [f"<p>Study <b>{escape(str(results.get('study', '')))}</b>: {len(results.get('trials', []))} trials, "
             f"{len(rows)} on the front.</p>",
             _table("search-front", ["trial", *objectives, "feasible", "params"], rows, "front-row")]
    if plots_available():
        for title, png in search_plots(results):
            parts.append(f'<figure><img class="plot" alt="{escape(title)}" src="data:image/png;base64,{png}">'
                         f"<figcaption>{escape(title)}</figcaption></figure>")
    else:
        parts.append("<p>Plots need matplotlib (pip install matplotlib).</p>")
    return "\n".join(parts)


def build_report(mg: ForgeGraph, title: str = "fxforge report", search_results: Mapping[str, Any] | None = None,
                 deploy: Sequence[DeployArtifactRow] | None = None, sensitivity: Any = None) -> str:
    """The report of ``mg`` as one HTML document (``search_results``: the JSON of SearchResult.to_json,
    checked field by field first: SearchResultsError; ``deploy``: deploy artifacts and their checks;
    ``sensitivity``: a SensitivityInfo (or ``{node: loss increase}``) shown as an overlay and a column)."""
    if search_results is not None:
        search_results = check_search_results(search_results)
    quant, quant_note = quant_rows(mg)
    h = build_hierarchy(mg, sensitivity=sensitivity, sqnr={q.name: q.sqnr_db for q in quant if q.sqnr_db is not None})
    modules = sum(1 for i in h.items.values() if i.kind == "group")
    params = list(mg.model.parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    nodes = sum(1 for _ in mg.nodes)
    cards = {"nodes": f"{nodes}", "frontend": mg.frontend, "parameters": f"{total:,}",
             "trainable": f"{trainable:,}", "passes": str(len(mg.history))}
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    notes = "".join(f"<li>{escape(n)}</li>" for n in mg.capture_notes)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1><p class='sub'>generated {stamp} by fxforge</p>",
        '<div class="cards">' + "".join(f"<span>{k}<br><b>{escape(v)}</b></span>" for k, v in cards.items()) + "</div>",
        f"<ul>{notes}</ul>" if notes else "",
        '<pre id="js-errors"></pre><div id="selftest" hidden></div>',
        f"<section><h2>Graph</h2><p class='sub'>{nodes} nodes in {modules} module groups.</p>"
        + graph_view_html(h, "graph") + "</section>",
        "<section><h2>Modules</h2><p class='sub'>One row per module that runs code; click a module for its "
        "nodes, a header to sort.</p>" + module_table(h) + "</section>",
        "<section><h2>Pass history</h2>" + _history(mg) + "</section>",
        "<section><h2>Quantization</h2>" + _quantization(quant, quant_note) + "</section>",
        "<section id='memory'><h2>Memory timeline</h2>" + _memory(mg) + "</section>",
        "<section><h2>Search</h2>" + _search(search_results) + "</section>",
        "<section id='deploy'><h2>Deploy</h2>" + deploy_section(deploy) + "</section>",
        f"<script>{JS}</script></body></html>",
    ]) + "\n"


def write_report(mg: ForgeGraph, path: str | Path, title: str = "fxforge report",
                 search_results: Mapping[str, Any] | None = None,
                 deploy: Sequence[DeployArtifactRow] | None = None, sensitivity: Any = None) -> Path:
    """Write :func:`build_report` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_report(mg, title, search_results, deploy, sensitivity), encoding="utf-8")
    return path
