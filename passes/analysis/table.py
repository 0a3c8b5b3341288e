"""Plain-text table formatting shared by the report passes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Left-aligned columns with a header rule; every row must have the same keys."""
    if not rows:
        return "(empty)"
    cols = list(columns) if columns is not None else list(rows[0])
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([line.rstrip(), rule, *body])
