"""Plain-text table formatting shared by the report passes and the CLI (fits a terminal width when asked)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

MIN_COLUMN = 6


def terminal_width(default: int = 120) -> int:
    """Columns of the terminal (``COLUMNS`` wins; ``default`` when not a terminal)."""
    return shutil.get_terminal_size((default, 24)).columns


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _fit(widths: list[int], max_width: int) -> list[int]:
    """Shrink the widest columns (never below MIN_COLUMN) until the row fits in ``max_width``."""
    widths = list(widths)
    while sum(widths) + 2 * (len(widths) - 1) > max_width:
        i = max(range(len(widths)), key=lambda k: widths[k])
        if widths[i] <= MIN_COLUMN:
            break
        widths[i] -= 1
    return widths


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 max_width: int | None = None) -> str:
    """Left-aligned columns with a header rule; with ``max_width`` wide cells are truncated with "…" to fit."""
    if not rows:
        return "(empty)"
    cols = list(columns) if columns is not None else list(rows[0])
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    if max_width is not None:
        widths = _fit(widths, max_width)
    line = "  ".join(_clip(c, w).ljust(w) for c, w in zip(cols, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(_clip(v, w).ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join([line.rstrip(), rule, *body])
