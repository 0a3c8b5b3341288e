"""``fxforge draw``'s DOT on a tiny BERT (no Graphviz needed): the report's module hierarchy as nested clusters at
a chosen depth, overlay colours on the graph view's scale with a legend, hostile names kept inside escaped
strings, and the renderer's error without ``dot``; rendered by the real ``dot`` under marker slow."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import bert_metadata_graph  # noqa: E402

from fxforge.report.dot import NA, RAMP, dot_string, hierarchy_dot  # noqa: E402
from fxforge.report.dot_render import GraphvizMissingError, write_dot  # noqa: E402
from fxforge.report.hierarchy import Hierarchy, build_hierarchy  # noqa: E402

QUOTED = r'"(?:[^"\\]|\\.)*"'
EVIL = "</script>\"{b}\\N\\l 'é"


@pytest.fixture(scope="module")
def bert() -> Any:
    return bert_metadata_graph()


def _unquote(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), s[1:-1])


def _boxes(text: str) -> dict[str, str]:
    """Item id -> DOT node id of every box drawn."""
    return {_unquote(q): n for n, q in re.findall(rf"^\s+(n\d+) \[id=({QUOTED})", text, re.M)}


def _clusters(text: str) -> list[str]:
    return [_unquote(q) for q in re.findall(rf"subgraph cluster_\d+ {{\n\s+id=({QUOTED})", text)]


def _edges(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^\s+(n\d+) -> (n\d+);", text, re.M)


def _root_groups(h: Hierarchy) -> set[str]:
    return {c for c in h.items[h.root].children if h.items[c].kind == "group"}


def test_depth_one_clusters_the_top_level_and_all_draws_every_node(bert: Any) -> None:
    h = build_hierarchy(bert)
    one = hierarchy_dot(h, depth=1)
    assert set(_clusters(one)) == _root_groups(h) and "g:bert" in _root_groups(h)  # one per top-level module
    boxes = _boxes(one)
    assert len(boxes) <= 30 and {"g:bert.embeddings", "g:bert.pooler", "n:classifier"} <= set(boxes)
    assert {d for e in _edges(one) for d in e} <= set(boxes.values())
    everything = hierarchy_dot(h, depth="all")
    boxes = _boxes(everything)
    assert sorted(boxes) == sorted(f"n:{n.name}" for n in bert.nodes)  # every node, no group box
    assert set(_clusters(everything)) == {i.id for i in h.groups()} - {h.root}
    pairs = {(s, d) for s, d in h.edges if s != d}
    assert len(_edges(everything)) == len(pairs) and set(_edges(everything)) == {(boxes[s], boxes[d]) for s, d in pairs}
    default = hierarchy_dot(h)  # the report's top level: the block list open, its blocks closed
    assert set(_clusters(default)) == set(h.expanded) - {h.root}
    assert {"g:bert.encoder.layer.0", "g:bert.encoder.layer.1"} <= set(_boxes(default))
    assert hierarchy_dot(h, depth=0).count("subgraph cluster_") == 0


def test_overlay_colours_on_the_view_scale_with_a_legend(bert: Any) -> None:
    linears = [n.name for n in bert.nodes if n.op == "call_module" and "dense" in n.name or n.name == "classifier"]
    sens = {name: 10.0 ** (k % 5 - 2) for k, name in enumerate(linears)}  # input data: 1e-2 .. 1e2
    h = build_hierarchy(bert, sensitivity=sens)
    text = hierarchy_dot(h, depth="all", overlay="sensitivity")
    fills = {_unquote(q): f for q, f in re.findall(rf"id=({QUOTED}), label={QUOTED}, tooltip={QUOTED}, "
                                                   r'fillcolor="(#[0-9a-f]{6})"', text)}
    lo, hi = min(sens, key=sens.__getitem__), max(sens, key=sens.__getitem__)
    assert fills[f"n:{lo}"] == RAMP[0] and fills[f"n:{hi}"] == RAMP[-1]
    assert fills["n:input_ids"] == NA and len({fills[f"n:{n}"] for n in sens}) == 5
    legend = text[text.index("subgraph cluster_legend"):]
    assert 'label="sensitivity (loss increase) (log scale)"' in legend
    assert [_unquote(q) for q in re.findall(rf"legend\d+ \[label=({QUOTED})", legend)] == \
        ["0.01", "0.1", "1", "10", "100", "n/a"]
    with pytest.raises(ValueError, match="unknown overlay 'heat'.*bits, sparsity"):
        hierarchy_dot(h, overlay="heat")
    with pytest.raises(ValueError, match="--sensitivity-data"):
        hierarchy_dot(build_hierarchy(bert), overlay="sensitivity")


def _evil_graph(bert: Any) -> Any:
    mg = bert.copy()
    for node in mg.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack and "layer.1.output" in str(list(stack.values())[-1][0]):
            key, (path, typ) = list(stack.items())[-1]
            stack[key] = (path.replace("layer.1.output", f"layer.1.{EVIL}"), typ)
    next(n for n in mg.nodes if n.op == "call_function").name = "f" + EVIL
    return mg


def test_hostile_names_stay_inside_escaped_strings(bert: Any) -> None:
    assert dot_string('a\\N"b\nc\x07\r\n') == '"a\\\\N\\"b\\nc\\n"'
    h = build_hierarchy(_evil_graph(bert))
    for depth in ("all", 1):
        text = hierarchy_dot(h, depth=depth)
        outside = re.sub(QUOTED, "S", text).replace(" -> ", " to ")
        assert not set(outside) & set("<>'é\\") and "script" not in outside and '"' not in outside
        assert outside.count("{") == outside.count("}")
        strings = [_unquote(q) for q in re.findall(QUOTED, text)]
        assert any(s.startswith("f" + EVIL) for s in strings)  # the renamed node's label
        assert depth == 1 or any(s.startswith(EVIL + "  (") for s in strings)  # the renamed module's cluster


def test_write_dot_text_and_a_clear_error_without_graphviz(bert: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    text = hierarchy_dot(build_hierarchy(bert), depth=1)
    assert write_dot(text, tmp_path / "a" / "g.dot").read_text(encoding="utf-8") == text
    with pytest.raises(ValueError, match=r"\.svg"):
        write_dot(text, tmp_path / "g.txt")
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it
    with pytest.raises(GraphvizMissingError, match="apt-get install graphviz"):
        write_dot(text, tmp_path / "g.svg")


@pytest.mark.slow
def test_dot_renders_clusters_and_hostile_labels(bert: Any, tmp_path: Path) -> None:
    from graphviz_dot import dot  # tests/report/graphviz_dot.py: installs Debian's graphviz when missing

    dot()
    h = build_hierarchy(_evil_graph(bert), sensitivity={"classifier": 0.5})
    for depth, overlay in ((None, "params"), ("all", "sensitivity")):
        svg = write_dot(hierarchy_dot(h, depth=depth, overlay=overlay), tmp_path / f"g-{depth}.svg")
        root = ET.parse(svg).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        clusters = [g for g in root.iter(f"{ns}g") if g.get("class") == "cluster"]
        nodes = [g for g in root.iter(f"{ns}g") if g.get("class") == "node"]
        text = hierarchy_dot(h, depth=depth, overlay=overlay)
        assert len(clusters) == len(_clusters(text)) + 1  # and the legend
        assert len(nodes) == len(_boxes(text)) + len(re.findall(r"legend\d+ \[label=", text))
        if depth is None:
            continue  # the renamed module and node sit in closed groups
        words = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
        assert "</script>" in words and "é" in words and "\\N\\l" in words  # drawn verbatim, XML-escaped in the file
        assert "</script>" not in svg.read_text(encoding="utf-8")
