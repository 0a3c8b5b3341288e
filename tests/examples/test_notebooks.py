"""The tutorial notebooks (examples/notebooks, issue 34 item 7): generated from the examples and up to date, and
each one executed headless (nbclient) in a kernel of this .venv on its QUICK settings, its displays offline HTML."""

from __future__ import annotations

import json
import re
import sys
from html import unescape
from pathlib import Path

import nbformat
import pytest

from fxforge.examples.notebooks.make_notebooks import TUTORIALS, Tutorial, main, path_of


def test_notebooks_are_generated_from_the_examples_and_up_to_date() -> None:
    """Edit an example's docstring or a tutorial's settings without regenerating, and this fails."""
    assert main(["--check"]) == 0, "run: python examples/notebooks/make_notebooks.py"
    shipped = sorted(p.stem for p in path_of(TUTORIALS[0]).parent.glob("*.ipynb"))
    assert shipped == sorted(t.module for t in TUTORIALS)
    for t in TUTORIALS:
        nb = nbformat.read(path_of(t), as_version=4)
        nbformat.validate(nb)
        assert f"from fxforge.examples.{t.module} import main" in nb.cells[2].source


def _kernel(root: Path) -> str:
    """A kernel spec under ``root`` that runs this interpreter (.venv/bin/python) with ipykernel."""
    spec = root / "kernels" / "fxforge-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fxforge (.venv)", "language": "python"}))
    return "fxforge-venv"


@pytest.mark.slow  # each notebook trains or searches on its tiny settings (seconds to minutes)
@pytest.mark.parametrize("tutorial", TUTORIALS, ids=[t.module for t in TUTORIALS])
def test_notebook_runs_headless(tutorial: Tutorial, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    name = _kernel(tmp_path / "jupyter")
    nb = nbformat.read(path_of(tutorial), as_version=4)
    client = NotebookClient(nb, kernel_name=name, timeout=1800, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # a failing cell raises CellExecutionError with its traceback
    run = nb.cells[2]
    assert not [o for o in run.outputs if o.output_type == "error"]
    if tutorial.show:
        html = [o.data["text/html"] for o in nb.cells[3].outputs if "text/html" in o.get("data", {})]
        framed = re.fullmatch(r'<iframe class="fxforge-frame" [^>]*srcdoc="([^"]*)"></iframe>', html[0] if html else "")
        assert framed, nb.cells[3].outputs
        from plotly.offline import get_plotlyjs

        page = unescape(framed.group(1)).replace(get_plotlyjs(), "")  # plotly.js, when inlined, is the one script
        assert "<svg" in page or "search-data" in page
        assert not re.search(r"<script[^>]*\ssrc=", page) and "<link" not in page  # nothing fetched: offline
