"""One self-contained HTML report of a ForgeGraph: drawing, node table, pass history, quantization, search plots."""

from . import notebook  # noqa: F401 - registers the Jupyter views (ForgeGraph, pass infos, search results)
from .html import build_report, write_report

__all__ = ["build_report", "write_report"]
