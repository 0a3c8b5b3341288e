"""Plots for the HTML report: search plots as base64 PNGs (matplotlib, Agg canvas, no pyplot global state),
and the memory timeline as inline SVG written here (no matplotlib needed: the graph sections never need it).

PNG over plotly: a plot is tens of kB instead of ~4.5 MB of inlined plotly.js per report, needs no
JavaScript to appear, and looks the same in every browser and offline viewer (and in print).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .memory_timeline import MemoryTimeline

__all__ = ["format_bytes", "memory_timeline_svg", "plots_available", "search_plots"]


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


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, three significant digits."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 760, 300, 70, 20, 46, 40


def memory_timeline_svg(tl: MemoryTimeline) -> str:
    """Live bytes per node as an inline SVG step plot: training (red) and inference (blue) curves, each peak
    marked with its node's name (escaped: names come from checkpoints)."""
    count, top = len(tl.nodes), max(max(tl.training), max(tl.inference), 1)
    width, height = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x(i: float) -> float:
        return _LEFT + width * i / max(count, 1)

    def y(v: float) -> float:
        return _TOP + height * (1 - v / top)

    def steps(curve: tuple[int, ...]) -> str:
        pts = []
        for i, v in enumerate(curve):
            pts += [f"{x(i):.1f},{y(v):.1f}", f"{x(i + 1):.1f},{y(v):.1f}"]
        return " ".join(pts)

    parts = [f'<svg id="memory-timeline" xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}" role="img" aria-label="live activation bytes per node" '
             'font-family="system-ui,sans-serif" font-size="11">',
             f'<rect x="{_LEFT}" y="{_TOP}" width="{width}" height="{height}" fill="#fff" stroke="#bbb"/>']
    for k in range(5):  # y grid and labels
        v = top * k / 4
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + width}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{_LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{escape(format_bytes(v))}</text>')
    for k in range(6):  # x labels: node indices
        i = round(count * k / 5)
        parts.append(f'<text x="{x(i):.1f}" y="{_TOP + height + 16}" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{_LEFT + width / 2}" y="{_H - 6}" text-anchor="middle">node (graph order)</text>')
    for row, (name, curve, peak, colour) in enumerate((("training", tl.training, tl.peak_training, "#d32f2f"),
                                                       ("inference", tl.inference, tl.peak_inference, "#1565c0"))):
        label = escape(f"peak {format_bytes(curve[peak])} at node {peak} {tl.nodes[peak]}")
        kept = " (tensors saved for backward kept to the end)" if name == "training" else ""
        parts.append(f'<polyline class="curve-{name}" fill="none" stroke="{colour}" stroke-width="1.5" '
                     f'points="{steps(curve)}"/>'
                     f'<circle class="peak-{name}" cx="{x(peak + 0.5):.1f}" cy="{y(curve[peak]):.1f}" r="4" '
                     f'fill="{colour}"><title>{name} {label}</title></circle>'
                     f'<text x="{_LEFT}" y="{14 + 15 * row}" fill="{colour}">● {escape(name)}{kept}: {label}</text>')
    return "".join(parts)
