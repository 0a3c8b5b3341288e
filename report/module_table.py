"""The report's per-module table: one sortable row per layer (module owning nodes), each with its nodes on expand.

Columns are the module path, its class, node count, precision (every distinct quantized format / dtype of its
nodes) and each overlay some module has a value for. A cell's ``data-sort`` holds the number it sorts by; the
first cell holds a ``<details>`` listing the module's nodes (op, kind, output shape, precision, figures).
"""

from __future__ import annotations

from html import escape

from .hierarchy import Hierarchy, module_rows
from .overlays import OVERLAYS

__all__ = ["module_table"]


def _num(value: float | None, unit: str = "") -> tuple[str, str]:
    """(text, sort key) of a figure; empty for a missing one (sorted last)."""
    if value is None:
        return "", ""
    if unit == "fraction":
        text = f"{value:.1%}"
    elif abs(value) >= 1e5:
        text = f"{value:,.0f}"
    else:
        text = f"{value:.4g}"
    return text, repr(float(value))


def _cell(text: str, sort: str = "") -> str:
    attr = f' data-sort="{escape(sort)}"' if sort else ""
    return f"<td{attr}>{escape(text)}</td>"


def module_table(h: Hierarchy, table_id: str = "modules") -> str:
    """The table of ``h``'s modules (graph order; click a header to sort, a module to see its nodes)."""
    rows = module_rows(h)
    shown = [o for o in OVERLAYS if o.key != "bits" and any(o.key in r.values for r in rows)]
    head = ["module", "type", "nodes", "precision", *(f"{o.title}" + (f" ({o.unit})" if o.unit else "")
                                                      for o in shown)]
    body = []
    for r in rows:
        nodes = [h.items[n] for n in r.nodes]
        precision = " / ".join(dict.fromkeys(n.info.get("precision", "") for n in nodes if n.info.get("precision")))
        detail = "".join(
            "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in (
                n.info.get("node", ""), n.info.get("op", ""), n.info.get("kind", ""), n.info.get("shape", ""),
                n.info.get("precision", ""),
                "; ".join(f"{k}={v:.4g}" for k, v in n.values.items() if not k.endswith("_n")))) + "</tr>"
            for n in nodes)
        first = (f'<td data-sort="{escape(r.path)}"><details><summary>{escape(r.path)}</summary>'
                 '<table class="node-detail"><tr><th>node</th><th>op</th><th>kind</th><th>shape</th><th>precision</th>'
                 f"<th>figures</th></tr>{detail}</table></details></td>")
        cells = [first, _cell(r.module), _cell(str(len(nodes)), str(len(nodes))), _cell(precision)]
        cells += [_cell(*_num(r.values.get(o.key), o.unit)) for o in shown]
        body.append('<tr class="module-row">' + "".join(cells) + "</tr>")
    header = "".join(f"<th>{escape(c)}</th>" for c in head)
    return (f'<table id="{table_id}" class="sortable"><thead><tr>{header}</tr></thead><tbody>\n'
            + "\n".join(body) + "\n</tbody></table>")
