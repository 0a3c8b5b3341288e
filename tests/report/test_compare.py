"""The before / after comparison (issue 34 item 3) on a real pruning pipeline of the tiny BERT: exactly the pruned
layers are flagged (data level), the summary counts what the graphs hold, and the page escapes hostile names."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from conftest import bert_metadata_graph

from fxforge import ForgeGraph
from fxforge.pipelines import Pipeline
from fxforge.report.compare import compare_graphs, comparison_html, write_comparison
from fxforge.search.objectives import weight_bits

PRUNED = ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.1.attention.self.value", "classifier"]


@pytest.fixture(scope="module")
def before_after() -> tuple[ForgeGraph, ForgeGraph]:
    before = bert_metadata_graph()
    pipe = Pipeline([("prune_transform_pass", {"weight": {"sparsity": 0.5}, "targets": {"name": PRUNED}})],
                    name="prune")
    after, _ = pipe(before)
    return before, after


@pytest.fixture(scope="module")
def checkpoints(before_after: tuple[ForgeGraph, ForgeGraph], tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cmp")
    return before_after[0].export(root / "dense"), before_after[1].export(root / "pruned")


def test_pruning_pipeline_flags_exactly_the_pruned_layers(before_after: tuple[ForgeGraph, ForgeGraph]) -> None:
    before, after = before_after
    cmp = compare_graphs(before, after)
    assert cmp.changed_layers() == set(PRUNED)
    assert cmp.tagged("pruned") == set(PRUNED)
    assert all("pruned 50%" in c.tags for c in cmp.layers)
    assert all("params" in c.kinds for c in cmp.layers)
    assert cmp.a.parameters == cmp.b.parameters  # masks are buffers: the count stays, the non-zeros drop
    dropped = sum(after.model.get_submodule(p).weight.numel() // 2 for p in PRUNED)
    assert cmp.a.nonzero_parameters - cmp.b.nonzero_parameters == dropped
    assert cmp.a.bytes_on_disk is None and cmp.b.accuracy is None and cmp.a.weight_bits is None  # unknown: not invented


def test_comparison_page_highlights_the_changed_nodes_of_both_sides(
        before_after: tuple[ForgeGraph, ForgeGraph], tmp_path: Path) -> None:
    before, after = before_after
    cmp = compare_graphs(before, after, accuracy=(0.9, 0.85))
    page = write_comparison(cmp, tmp_path / "cmp.html").read_text()
    assert re.findall(r"<tr class='layer-row' data-path='([^']+)'", page) == [c.path for c in cmp.layers]
    style = re.sub(r"\\([0-9a-f]{6})", lambda m: chr(int(m.group(1), 16)),  # CSS escapes decoded
                   page[page.index("<style>"):page.index("</style>")])
    nodes = {"n:classifier", "n:bert_encoder_layer_0_intermediate_dense", "n:bert_encoder_layer_1_attention_self_value"}
    for side in ("a", "b"):
        flagged = set(re.findall(rf'#side-{side}-graph g\.fxg-box\[data-id="(n:[^"]+)"\]', style))
        assert flagged == nodes
        groups = set(re.findall(rf'#side-{side}-graph g\.fxg-frame\[data-id="(g:[^"]+)"\]', style))
        assert {"g:bert.encoder.layer.0", "g:bert.encoder.layer.1"} <= groups
        assert not any(g.startswith("g:bert.encoder.layer.1.output") for g in groups)  # only groups holding changes
    assert page.count('<div class="fxg" id="side-') == 2 and "http" not in style
    assert "0.8500" in page and "unknown" in page  # accuracy given; bytes on disk unknown without checkpoints
    framed = cmp._repr_html_()  # Jupyter: the same page in a sandboxed frame
    assert framed.startswith('<iframe class="fxforge-frame"') and html.escape(f"data-path='{PRUNED[0]}'") in framed


def test_checkpoints_give_bytes_on_disk_and_hostile_names_are_escaped(checkpoints: tuple[Path, Path]) -> None:
    pa, pb = checkpoints
    ra, rb = ForgeGraph.from_checkpoint(pa), ForgeGraph.from_checkpoint(pb)
    cmp = compare_graphs(ra, rb, names=("</script><b>x", 'q"é'), checkpoints=(pa, pb), weight_bits=weight_bits)
    assert cmp.changed_layers() == set(PRUNED)  # also after the round trip through checkpoints
    assert cmp.a.bytes_on_disk == (pa / "weights.safetensors").stat().st_size
    page = comparison_html(cmp)
    assert "</script><b>x" not in page and "&lt;/script&gt;&lt;b&gt;x" in page
    assert cmp.b.weight_bits == cmp.a.weight_bits == 32 * sum(p.numel() for p in ra.model.parameters())


def test_cli_report_of_two_checkpoints_writes_the_comparison(
        checkpoints: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fxforge report A B`` (in process): the page flags the pruned layers and shows both accuracies given."""
    from fxforge.cli.app import main

    pa, pb = checkpoints
    out = tmp_path / "cmp.html"
    assert main(["report", str(pa), str(pb), "-o", str(out), "--accuracy", "0.91", "--accuracy", "0.875"]) == 0
    assert "3 changed layer(s)" in capsys.readouterr().out
    page = out.read_text()
    assert sorted(re.findall(r"<tr class='layer-row' data-path='([^']+)'", page)) == sorted(PRUNED)
    assert "0.9100" in page and "0.8750" in page
    assert main(["report", str(pa), str(pb), "-o", str(out), "--accuracy", "0.9"]) == 1
    assert "--accuracy takes two values" in capsys.readouterr().err


@pytest.mark.slow  # Chromium
def test_comparison_page_outlines_exactly_the_pruned_layers_in_chromium(
        before_after: tuple[ForgeGraph, ForgeGraph], tmp_path: Path) -> None:
    """Rendered with every group opened, the boxes outlined in red are exactly the pruned layers' nodes (and the
    groups holding them); at first the closed layers holding changes are outlined; a layer link finds it."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from browser import Browser

    page = write_comparison(compare_graphs(*before_after), tmp_path / "cmp.html")
    red = ("(function(v){ return Array.prototype.filter.call(document.querySelectorAll('#' + v + ' g.fxg-box'), "
           "function(g){ return getComputedStyle(g.querySelector('rect')).stroke === 'rgb(211, 47, 47)'; })"
           ".map(function(g){ return g.dataset.id; }); })")
    expected = {"n:classifier", "n:bert_encoder_layer_0_intermediate_dense",
                "n:bert_encoder_layer_1_attention_self_value"}
    with Browser(tmp_path / "profile") as b:
        b.open(page.resolve().as_uri(), "document.body && document.body.dataset.ready === '1'")
        for view in ("side-a-graph", "side-b-graph"):
            top = set(b.js(f"{red}('{view}')"))  # at first: the encoder's layers open, their blocks closed
            assert top == {"g:bert.encoder.layer.0", "g:bert.encoder.layer.1", "n:classifier"}, top
            b.click(f'#{view} button[data-act="expand"]')
            assert {i for i in b.js(f"{red}('{view}')") if i.startswith("n:")} == expected
        b.click("a.layer-link[data-path='classifier']")
        assert "n:classifier" in b.js("Array.prototype.map.call(document.querySelectorAll('#side-b-graph .fxg-match'),"
                                      " function(g){ return g.dataset.id; })")
        assert b.errors == [] and b.js("document.getElementById('js-errors').textContent.trim()") == ""
