"""Jupyter display (issue 34 item 7): a ForgeGraph shows its report and a pass's info a table, both as
self-contained offline HTML; without fxforge.report imported nothing is registered and Jupyter falls back to repr."""

from __future__ import annotations

import html
import re
import subprocess
import sys

import pytest
from conftest import bert_metadata_graph

import fxforge.report  # noqa: F401 - registers the views
from fxforge import passes
from fxforge.report.html import build_report


def _framed(markup: str) -> str:
    found = re.fullmatch(r'<iframe class="fxforge-frame" sandbox="allow-scripts" style="[^"]*" srcdoc="([^"]*)">'
                         r"</iframe>", markup)
    assert found, markup[:200]
    return html.unescape(found.group(1))


def _undated(page: str) -> str:
    return re.sub(r"generated [0-9: -]+UTC", "", page)


def test_graph_and_pass_info_display_themselves() -> None:
    mg = bert_metadata_graph()
    page = _framed(mg._repr_html_())
    assert _undated(page) == _undated(build_report(mg, title=repr(mg)))  # the report page, whole, in the frame
    assert "<svg" in page and "<script src" not in page
    mg, info = passes.prune_transform_pass(mg, {"weight": {"sparsity": 0.5}, "targets": {"name": "classifier"}})
    table = info._repr_html_()
    assert "<caption style='text-align:left'>PruneInfo</caption>" in table
    assert re.findall(r"<tr><td><b>(\w+)</b></td>", table) == info.keys()
    assert "&quot;classifier&quot;" in table  # JSON of the layer figures, escaped


@pytest.mark.slow  # a fresh interpreter importing fxforge (~10 s)
def test_without_the_report_package_the_display_is_the_plain_repr() -> None:
    code = ("import fxforge, torch; from fxforge import ForgeGraph; "
            "mg = ForgeGraph(torch.nn.Linear(2, 2), (torch.ones(1, 2),)); "
            "assert mg._repr_html_() is None, 'a view without fxforge.report'; import fxforge.report; "
            "assert mg._repr_html_().startswith('<iframe')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
