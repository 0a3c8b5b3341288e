"""The hierarchical graph view as a self-contained HTML fragment: reusable in the report, in a notebook's
``_repr_html_`` and on a before/after page (several views per page are fine: ids are per view).

API::

    graph_view_html(mg_or_hierarchy, view_id=None, sensitivity=None, sqnr=None) -> str   # <div> + <script>
    graph_view_page(mg, title="graph") -> str                                            # a whole HTML page
    view_json(h) -> str                      # the view's data, escaped for a <script> element

The fragment carries its own style, data (JSON in ``<script type="application/json">``, with ``<``, ``>``,
``&`` and line separators escaped, so a module named ``</script>`` stays data) and script (report/
graph_view_js.py; no CDN, no library). It opens on the hierarchy's default groups (report/hierarchy.py),
offers only the overlays some node has a value for, and sets ``data-ready="1"`` on its ``<div>`` once drawn
(``data-first-render-ms``: how long its script took to the first drawing; ``data-ready-at-ms``: that moment, from
the page's navigation start; ``data-boxes``: boxes drawn; ``data-render-ms``: the latest redraw).
"""

from __future__ import annotations

import json
import re
import uuid
from html import escape
from typing import Any

from ..graph.forge_graph import ForgeGraph
from .graph_view_js import GRAPH_VIEW_CSS, GRAPH_VIEW_JS
from .hierarchy import Hierarchy, build_hierarchy
from .overlays import OVERLAYS

__all__ = ["graph_view_html", "graph_view_page", "view_json"]

_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def view_json(h: Hierarchy) -> str:
    """``h`` as compact JSON safe inside a ``<script>`` element (no ``</script>``, ``<!--`` or line separators)."""
    text = json.dumps(h.to_json(), separators=(",", ":"), ensure_ascii=False)
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_UNSAFE[m.group(0)], text)


def _view_id(view_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z][\w-]{0,63}", view_id):
        raise ValueError(f"graph view id {view_id!r} must be a letter then letters, digits, '_' or '-' (an HTML id)")
    return view_id


def graph_view_html(graph: ForgeGraph | Hierarchy, view_id: str | None = None, sensitivity: Any = None,
                    sqnr: dict[str, float] | None = None) -> str:
    """The view of ``graph`` (a ForgeGraph, grouped here, or a Hierarchy already built) as one HTML fragment
    (``view_id``: its element id; None: a fresh ``fxg-<hex>``, so notebook outputs never share one)."""
    h = graph if isinstance(graph, Hierarchy) else build_hierarchy(graph, sensitivity=sensitivity, sqnr=sqnr)
    vid = _view_id(view_id if view_id is not None else f"fxg-{uuid.uuid4().hex[:12]}")
    present = {k for item in h.items.values() for k in item.values}
    options = ['<option value="kind">node kind</option>'] + [
        f'<option value="{o.key}">{escape(o.title)}</option>' for o in OVERLAYS if o.key in present]
    return (
        f'<div class="fxg" id="{vid}"><style>{GRAPH_VIEW_CSS}</style>'
        '<div class="fxg-bar"><label>colour by <select class="fxg-overlay">' + "".join(options) + "</select></label>"
        '<input class="fxg-search" type="search" placeholder="search by name" aria-label="search by name">'
        '<span class="fxg-found"></span><button type="button" data-act="expand">expand all</button>'
        '<button type="button" data-act="collapse">collapse</button><button type="button" data-act="fit">fit</button>'
        "<span class='sub'>click a module to open it, its title to close it; wheel: zoom, drag: pan</span></div>"
        '<div class="fxg-legend"></div><div class="fxg-canvas"><svg class="fxg-svg" xmlns="http://www.w3.org/2000/svg">'
        '<g class="fxg-vp"></g></svg></div><div class="fxg-detail"></div>'
        f'<script type="application/json" class="fxg-data">{view_json(h)}</script>'
        f"<script>{GRAPH_VIEW_JS}\nwindow.fxforgeGraphView(document.getElementById({json.dumps(vid)}));</script></div>"
    )


def graph_view_page(graph: ForgeGraph | Hierarchy, title: str = "fxforge graph") -> str:
    """A whole offline HTML page holding only the view (``fxforge draw --html``, quick looks)."""
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{escape(title)}</title></head><body><h1>{escape(title)}</h1>"
            f"{graph_view_html(graph)}</body></html>\n")
