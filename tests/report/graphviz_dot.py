"""Debian's Graphviz for the drawing tests: ``dot`` found on PATH, else installed with apt-get under the file lock
the chromium helper (browser.py) takes, failing the test loudly when that is impossible. (Not graphviz.py: that
name is a PyPI package's.)"""

from __future__ import annotations

from apt_tool import apt_tool


def dot() -> str:
    """Path of Graphviz's ``dot``, installing Debian's ``graphviz`` when missing (fails if impossible)."""
    return apt_tool("graphviz", "dot")
