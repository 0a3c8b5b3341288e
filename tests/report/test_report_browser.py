"""The HTML report in a real headless Chromium driven over the DevTools protocol (tests/report/browser.py):
MiniLM's report opens on its layers, a click opens one, the overlay menu recolours the boxes, search finds a
module, no console errors; a quantized checkpoint's report shows its real widths. Screenshots of the closed and
opened views are kept under the test's tmp dir (paths printed); the render time is printed, not asserted."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from browser import Browser  # noqa: E402
from cli_support import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

SEARCH = {"study": "demo", "objectives": ["accuracy", "latency_ms", "avg_weight_bits"],
          "directions": ["maximize", "minimize", "minimize"], "baseline": {"accuracy": 0.86, "avg_weight_bits": 32},
          "front": [{"trial": 1, "accuracy": 0.85, "latency_ms": 3.0, "avg_weight_bits": 8.0, "feasible": True,
                     "params": {"w": 8}},
                    {"trial": 2, "accuracy": 0.80, "latency_ms": 2.0, "avg_weight_bits": 4.0, "feasible": True,
                     "params": {"w": 4}}],
          "trials": [{"trial": i, "accuracy": 0.7 + 0.03 * i, "latency_ms": 1.0 + i, "avg_weight_bits": 2.0 + 2 * i}
                     for i in range(5)]}
READY = "document.getElementById('graph') && document.getElementById('graph').dataset.ready === '1' " \
        "&& document.body.dataset.ready === '1'"
BOXES = "Array.prototype.map.call(document.querySelectorAll('#graph .fxg-box'), function(g){ " \
        "return [g.dataset.id, g.textContent, g.querySelector('rect').getAttribute('fill')]; })"


def _page_errors(b: Browser) -> list[str]:
    return [*b.errors, *filter(None, [b.js("document.getElementById('js-errors').textContent.trim()")])]


def test_minilm_report_opens_on_its_layers_and_responds(minilm_classifier: Any, tmp_path: Path) -> None:
    from fxforge import ForgeGraph, passes
    from fxforge.report import write_report

    mg = ForgeGraph(copy.deepcopy(minilm_classifier), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    mg, _ = passes.profile_analysis_pass(mg, {"runs": 1})
    html = write_report(mg, tmp_path / "minilm.html", title="MiniLM")
    size = html.stat().st_size
    print(f"\nMiniLM report: {size / 2**20:.2f} MiB ({html})")
    assert size <= 2 * 2**20

    with Browser(tmp_path / "profile") as b:
        b.open(html.resolve().as_uri(), READY)
        view = b.js("(function(){ var d = document.getElementById('graph').dataset; "
                    "return [d.readyAtMs, d.firstRenderMs]; })()")
        print(f"render: graph drawn {view[0]} ms after navigation start, the view's script took {view[1]} ms")
        boxes = b.js(BOXES)
        labels = " | ".join(text for _, text, _ in boxes)
        for name in ("embeddings", "pooler", "classifier", *(f"layer.{k}" for k in range(6))):
            assert name in labels, (name, labels)
        assert len(boxes) <= 30
        assert not b.js("document.querySelector('#graph .fxg-frame[data-id=\"g:bert.encoder.layer.0\"]')")
        collapsed = b.screenshot(tmp_path / "minilm-collapsed.png")

        b.click('#graph .fxg-box[data-id="g:bert.encoder.layer.0"]')
        assert b.js("!!document.querySelector('#graph .fxg-frame[data-id=\"g:bert.encoder.layer.0\"]')")
        opened = {i for i, _, _ in b.js(BOXES)}
        assert {"g:bert.encoder.layer.0.attention", "g:bert.encoder.layer.0.intermediate"} <= opened, opened
        expanded = b.screenshot(tmp_path / "minilm-expanded.png")
        print(f"screenshots: {collapsed} {expanded}")

        before = {i: fill for i, _, fill in b.js(BOXES)}
        for overlay, title in (("params", "parameters"), ("flops", "FLOPs")):
            b.js(f"(function(){{var s = document.querySelector('#graph select.fxg-overlay'); s.value = '{overlay}';"
                 "s.dispatchEvent(new Event('change'));})()")
            after = {i: fill for i, _, fill in b.js(BOXES)}
            assert sum(after[i] != before[i] for i in before) >= len(before) // 2, (overlay, after)
            assert title in b.js("document.querySelector('#graph .fxg-legend').textContent")
            before = after
        b.js("(function(){var s = document.querySelector('#graph input.fxg-search'); s.value = 'pooler';"
             "s.dispatchEvent(new Event('input'));})()")
        found = b.js("Array.prototype.map.call(document.querySelectorAll('#graph .fxg-match'), "
                     "function(g){ return g.dataset.id; })")
        assert "g:bert.pooler" in found and "g:bert.embeddings" not in found, found
        zoom = "document.querySelector('#graph g.fxg-vp').getAttribute('transform')"
        before_zoom, canvas = b.js(zoom), b.js("(function(){ var r = document.querySelector('#graph .fxg-canvas')"
                                               ".getBoundingClientRect(); return [r.left + 200, r.top + 200]; })()")
        b.send("Input.dispatchMouseEvent", type="mouseWheel", x=canvas[0], y=canvas[1], deltaX=0, deltaY=-400)
        assert b.js(zoom) != before_zoom and "scale(" in b.js(zoom)  # the wheel zooms about the pointer
        assert _page_errors(b) == []


def test_quantized_checkpoint_report_shows_real_widths(tmp_path: Path) -> None:
    from fxforge import ForgeGraph
    from fxforge.report import write_report

    make_checkpoint(tmp_path / "ckpt")  # tiny BERT, every Linear integer in8 w8 b8
    mg = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    html = write_report(mg, tmp_path / "report.html", search_results=json.loads(json.dumps(SEARCH)))
    with Browser(tmp_path / "profile") as b:
        b.open(f"{html.resolve().as_uri()}#selftest", READY)
        assert b.js("document.getElementById('selftest').textContent") == "sorted-ok"
        assert b.js("document.querySelectorAll('img.plot').length") == 2  # Pareto front and accuracy vs bits
        b.js("(function(){var s = document.querySelector('#graph select.fxg-overlay'); s.value = 'bits';"
             "s.dispatchEvent(new Event('change'));})()")
        b.js("(function(){var s = document.querySelector('#graph input.fxg-search'); s.value = 'self.query';"
             "s.dispatchEvent(new Event('input'));})()")
        query = b.js("document.querySelector('#graph .fxg-box[data-id=\"n:bert_encoder_layer_0_attention_self_"
                     "query\"]').textContent")
        assert "integer in8 w8 b8" in query and "32" not in query, query
        legend = b.js("document.querySelector('#graph .fxg-legend').textContent")
        assert "precision" in legend and "8" in legend, legend
        row = b.js("Array.prototype.filter.call(document.querySelectorAll('#modules tr.module-row'), function(r){"
                   "return r.cells[0].dataset.sort === 'bert.encoder.layer.0.attention.self.query'; })[0]"
                   ".cells[3].textContent")
        assert row == "integer in8 w8 b8"
        b.click("#modules tr.module-row details summary")  # a module's nodes on expand
        assert b.js("document.querySelector('#modules tr.module-row details').open") is True
        assert b.js("document.querySelector('#modules tr.module-row details table.node-detail').rows.length") > 1
        assert "http://" not in b.js("document.documentElement.outerHTML").replace("http://www.w3.org/2000/svg", "")
        print(f"\nquantized report screenshot: {b.screenshot(tmp_path / 'quantized.png')}")
        assert _page_errors(b) == []
