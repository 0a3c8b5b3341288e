"""The search page (issue 34 item 4) of a real tiny mixed-precision search: the interactive Pareto front's points
are the study's front, every trial has a row linked to its point, importances come from the study, plotly.js is
inlined once (no CDN), and the page reads the results JSON as well."""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import tiny_search_setup

from fxforge.report.search_json import load_search_results
from fxforge.report.search_pages import search_page
from fxforge.search import MixedPrecisionSpace, Search, SearchResult

SPACE = MixedPrecisionSpace({"integer": {"width": [2, 3, 4, 6, 8], "frac_width": [1, 2]}},
                            roles=("weight", "data_in"), per="layer")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> SearchResult:
    mg, task = tiny_search_setup(64)
    return Search(SPACE, ["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=8, sampler="random",
                  run_dir=tmp_path_factory.mktemp("search"), progress=False, seed=0).run()


def _data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="search-data">(.*?)</script>', page, re.S)
    assert found
    return json.loads(found.group(1))


def _importances(page: str) -> dict[str, list[float]]:
    rows = re.findall(r"<tr class='importance-row' data-param='([^']+)'>(.*?)</tr>", page)
    return {p: [float(v) for v in re.findall(r"<td>([0-9.]+)</td>", cells)] for p, cells in rows}


def test_search_page_of_a_study(result: SearchResult) -> None:
    """The page a SearchResult shows in Jupyter (framed: the page itself, attribute-escaped)."""
    import fxforge.report  # noqa: F401 - registers the views

    framed = re.fullmatch(r'<iframe [^>]*srcdoc="([^"]*)"></iframe>', result._repr_html_())
    assert framed
    page = html.unescape(framed.group(1))
    data = _data(page)
    front = {r["trial"] for r in result.rows()}
    by_name = {t["name"]: t for t in data["traces"]}
    assert set(by_name["Pareto front"]["customdata"]) == front
    assert set(by_name["trials"]["customdata"]) == {t.number for t in result.completed()} - front
    assert data["layout"]["xaxis"]["title"]["text"] == "avg_weight_bits"
    rows = re.findall(r"<tr id='trial-(\d+)' class='([^']+)'>", page)
    assert [int(n) for n, _ in rows] == [t.number for t in result.study.trials]
    assert {int(n) for n, cls in rows if "front" in cls} == front
    assert sorted(int(n) for n in re.findall(r"class='point-link' data-trial='(\d+)'", page)) == \
        sorted(t.number for t in result.completed())
    from plotly.offline import get_plotlyjs

    plotly_js = get_plotlyjs()
    assert page.count(plotly_js[:500]) == 1
    rest = page.replace(plotly_js, "")
    assert "<script src" not in rest and "http" not in rest  # nothing fetched: offline
    imp = _importances(page)
    assert set(imp) == set(result.study.trials[0].params)
    for col in range(2):
        assert abs(sum(v[col] for v in imp.values()) - 1) < 0.01
    bits = {p: v[1] for p, v in imp.items()}  # avg_weight_bits depends on weight widths; fc1 holds most weights
    assert max(bits, key=bits.get) == "fc1:integer:weight_width"


def test_search_page_of_the_results_json(result: SearchResult, tmp_path: Path) -> None:
    """From the JSON `fxforge search --results` writes: the same front and parameters, hostile names escaped."""
    doc = load_search_results(result.to_json(tmp_path / "results.json"))
    doc["study"] = "</script><img src=x onerror=alert(1)>"
    page = search_page(doc)
    assert "<img src=x" not in page and "&lt;/script&gt;&lt;img" in page
    data = _data(page)
    front = next(t for t in data["traces"] if t["name"] == "Pareto front")
    assert set(front["customdata"]) == {r["trial"] for r in result.rows()}
    assert set(_importances(page)) == set(result.study.trials[0].params)


@pytest.mark.slow  # Chromium renders a 5 MB page
def test_search_page_links_a_trial_to_its_point_in_chromium(result: SearchResult, tmp_path: Path) -> None:
    """``fxforge report --search`` writes the page; in Chromium plotly draws both plots without errors, a trial's
    link marks its point and row, a click on a point marks its row, and ``#pick-N`` opens on trial N."""
    sys.path.insert(0, str(Path(__file__).parent))
    from browser import Browser
    from cli.cli_support import make_checkpoint

    from fxforge.cli.app import main

    make_checkpoint(tmp_path / "ckpt")
    results = result.to_json(tmp_path / "results.json")
    assert main(["report", str(tmp_path / "ckpt"), "-o", str(tmp_path / "r.html"), "--search", str(results)]) == 0
    page = tmp_path / "r-search.html"  # `fxforge report --search` writes the search page beside the report
    first, last = result.rows()[0]["trial"], result.rows()[-1]["trial"]
    with Browser(tmp_path / "profile") as b:
        b.open(f"{page.resolve().as_uri()}#pick-{first}", "document.body && document.body.dataset.ready === '1'")
        assert b.js("document.getElementById('pareto-plot').dataset.picked") == str(first)
        assert b.js("document.querySelectorAll('.main-svg').length") >= 2  # the front and the importances
        b.click(f"a.point-link[data-trial='{last}']")
        assert b.js("document.getElementById('pareto-plot').dataset.picked") == str(last)
        assert b.js(f"document.getElementById('trial-{last}').classList.contains('picked')")
        assert b.errors == [] and b.js("document.getElementById('js-errors').textContent.trim()") == ""
