"""Search plots for the HTML report as base64 PNGs (matplotlib, Agg canvas, no pyplot global state).

PNG over plotly: a plot is tens of kB instead of ~4.5 MB of inlined plotly.js per report, needs no
JavaScript to appear, and looks the same in every browser and offline viewer (and in print).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plots_available", "search_plots"]


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _png(draw: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _points(rows: Sequence[Mapping[str, Any]], x: str, y: str) -> list[tuple[float, float]]:
    out = []
    for r in rows:
        vx, vy = r.get(x), r.get(y)
        if isinstance(vx, int | float) and isinstance(vy, int | float) and math.isfinite(vx) and math.isfinite(vy):
            out.append((float(vx), float(vy)))
    return out


def _scatter(trials: Sequence[Mapping[str, Any]], front: Sequence[Mapping[str, Any]],
             baseline: Mapping[str, Any], x: str, y: str, title: str) -> str | None:
    every, best = _points(trials, x, y), sorted(_points(front, x, y))
    if not every and not best:
        return None

    def draw(ax: Any) -> None:
        if every:
            ax.scatter(*zip(*every), s=18, color="#9e9e9e", label="trials")
        if best:
            ax.plot(*zip(*best), "o-", color="#d32f2f", label="Pareto front")
        base = _points([baseline], x, y)
        if base:
            ax.scatter(*zip(*base), marker="*", s=140, color="#1565c0", label="baseline")
        ax.set_xlabel(x, parse_math=False)  # names from a file: never matplotlib's mathtext ($...$ nests,
        ax.set_ylabel(y, parse_math=False)  # and its parser recurses)
        ax.set_title(title, parse_math=False)
        ax.legend(fontsize=8)

    return _png(draw)


def search_plots(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``[(title, base64 PNG)]``: the Pareto front of the first two objectives and accuracy vs bits when present."""
    objectives = [str(o) for o in results.get("objectives", [])]
    trials, front = list(results.get("trials", [])), list(results.get("front", []))
    baseline = results.get("baseline") or {}
    plots: list[tuple[str, str]] = []
    if len(objectives) >= 2:
        title = f"Pareto front: {objectives[0]} vs {objectives[1]}"
        png = _scatter(trials, front, baseline, objectives[1], objectives[0], title)
        if png:
            plots.append((title, png))
    bits = next((o for o in objectives if "bits" in o), None)
    if "accuracy" in objectives and bits and objectives[:2] != ["accuracy", bits]:
        png = _scatter(trials, front, baseline, bits, "accuracy", "Accuracy vs bits")
        if png:
            plots.append(("Accuracy vs bits", png))
    return plots
