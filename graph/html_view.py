"""Rich display hooks: how a ForgeGraph, a pass's info or a search result shows itself in Jupyter.

graph/ never imports report/ (nor do passes/ or search/), so each ``_repr_html_`` asks this registry and
report/notebook.py registers the views when ``fxforge.report`` is imported. With no view registered the
method returns None and Jupyter shows the plain ``repr``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["html_view", "register_html_view"]

_VIEWS: list[tuple[Callable[[object], bool], Callable[[object], str]]] = []


def register_html_view(matches: Callable[[object], bool], render: Callable[[object], str]) -> None:
    """Show objects for which ``matches(obj)`` is true as ``render(obj)`` (the newest registration wins)."""
    _VIEWS.insert(0, (matches, render))


def html_view(obj: object) -> str | None:
    """The HTML of ``obj`` from the first matching view, or None (no view registered for it)."""
    for matches, render in _VIEWS:
        if matches(obj):
            return render(obj)
    return None
