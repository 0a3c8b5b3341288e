"""How fxforge objects show themselves in Jupyter (``_repr_html_``): offline, no server, no CDN.

A whole report page is framed in an ``<iframe srcdoc>`` so its styles and script stay inside the frame and
never touch the notebook's page; small values (a pass's info) are a plain escaped table. Importing this module
(``import fxforge.report`` does) registers the views the objects' ``_repr_html_`` ask graph/html_view for.
"""

from __future__ import annotations

import dataclasses
import json
from html import escape
from typing import TYPE_CHECKING, Any, cast

from ..graph.forge_graph import ForgeGraph
from ..graph.html_view import register_html_view
from ..passes.contract import PassInfo

if TYPE_CHECKING:
    from .search_pages import SearchResult

__all__ = ["framed", "graph_html", "info_html", "search_result_html"]

MAX_CELL = 400


def framed(document: str, height: int = 640) -> str:
    """``document`` (a full HTML page) inside a sandboxed iframe, attribute-escaped (scripts run in the frame)."""
    return (f'<iframe class="fxforge-frame" sandbox="allow-scripts" style="width:100%;height:{int(height)}px;'
            f'border:1px solid #ccc" srcdoc="{escape(document, quote=True)}"></iframe>')


def graph_html(mg: ForgeGraph) -> str:
    """The report of ``mg`` (the same page ``fxforge report`` writes), framed for a notebook cell."""
    from .html import build_report

    return framed(build_report(mg, title=repr(mg)))


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    return escape(text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…")


def info_html(info: Any) -> str:
    """A pass's info as a two-column table (field, value), one row per dataclass field."""
    data = info.to_json() if callable(getattr(info, "to_json", None)) else {}  # nested dataclasses as JSON
    rows = "".join(f"<tr><td><b>{escape(f.name)}</b></td><td><code>{_cell(data.get(f.name, getattr(info, f.name)))}"
                   "</code></td></tr>" for f in dataclasses.fields(info))
    return (f"<table class='fxforge-info'><caption style='text-align:left'>{escape(type(info).__name__)}</caption>"
            f"<tbody>{rows}</tbody></table>")


def search_result_html(result: SearchResult) -> str:
    """The search page of ``result`` (report/search_pages), framed for a notebook cell."""
    from .search_pages import search_page

    return framed(search_page(result), height=900)


def _is_search_result(obj: object) -> bool:
    from .search_pages import SearchResult

    return isinstance(obj, SearchResult)


register_html_view(lambda obj: isinstance(obj, ForgeGraph), lambda obj: graph_html(cast(ForgeGraph, obj)))
register_html_view(lambda obj: isinstance(obj, PassInfo), info_html)
register_html_view(_is_search_result, lambda obj: search_result_html(cast("SearchResult", obj)))
