"""mg.draw: valid SVG, one box per node, a layered layout that keeps edges pointing down."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.graph.draw import BOX_W, GAP_X, layout, to_svg

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def ckpt_bert_graph() -> ForgeGraph:
    torch.manual_seed(0)
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _boxes(root: ET.Element) -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG}rect") if e.get("class") == "node-box"]


def test_bert_svg_is_valid_xml_with_one_box_per_node(ckpt_bert_graph: ForgeGraph, tmp_path: Path) -> None:
    path = ckpt_bert_graph.draw(tmp_path / "figs.v2" / "bert.graph.svg")
    assert path == tmp_path / "figs.v2" / "bert.graph.svg"
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    nodes = list(ckpt_bert_graph.nodes)
    assert len(_boxes(root)) == len(nodes) > 50
    groups = [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
    assert [g.get("data-name") for g in groups] == [n.name for n in nodes]
    text = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "linear" in text and "layer_norm" in text and re.search(r"\[\d+, \d+, 32\] float32", text)
    edges = sum(len(n.all_input_nodes) for n in nodes)
    assert len([p for p in root.iter(f"{SVG}path") if p.get("marker-end")]) == edges


def test_layout_rows_follow_edges_and_boxes_do_not_overlap(ckpt_bert_graph: ForgeGraph) -> None:
    pos = layout(ckpt_bert_graph.model.graph)
    for node in ckpt_bert_graph.nodes:
        for src in node.all_input_nodes:
            assert pos[src][1] < pos[node][1], (src.name, node.name)
    rows: dict[int, list[float]] = {}
    for x, r in pos.values():
        rows.setdefault(r, []).append(x)
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= BOX_W + GAP_X - 1e-6 for a, b in zip(xs, xs[1:]))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


def test_draw_without_metadata_and_escapes_names() -> None:
    mg = ForgeGraph(Tiny(), frontend="fx")
    svg = to_svg(mg)
    root = ET.fromstring(svg)
    assert len(_boxes(root)) == len(list(mg.nodes))
    assert "float32" not in svg  # no metadata: no shapes
    mg.model.graph.find_nodes(op="placeholder")[0].name = "x<&>"
    assert len(_boxes(ET.fromstring(to_svg(mg)))) == len(list(mg.nodes))
