"""The ``fxforge`` command line; ``main`` is the console script (``python -m fxforge`` too)."""

from .app import app, main

__all__ = ["app", "main"]
