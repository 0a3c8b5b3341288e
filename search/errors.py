"""Errors of the search package: one type, one line that says what to fix."""

from __future__ import annotations


class SearchError(ValueError):
    """A search cannot start or continue as configured (bad space, unreachable storage, study clash, ...)."""
