"""The hierarchical graph view's data on a tiny BERT (no browser): grouping by module path, the default top
level, per-group layered layouts, overlay values (real quantized widths, sparsity, parameters, sensitivity),
module paths of a checkpoint (reloaded BERT and zoo GPT show the live view), and hostile module / node names
kept as data."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import make_gpt, make_tiny_bert  # noqa: E402

QUANT = {"by": "type", "default": {"config": {"name": None}},
         "linear": {"config": {"name": "integer", "data_in_width": 6, "data_in_frac_width": 3,
                               "weight_width": 4, "weight_frac_width": 2, "bias_width": 8, "bias_frac_width": 4}}}
QUERY = "n:bert_encoder_layer_0_attention_self_query"


@pytest.fixture(scope="module")
def quantized() -> Any:
    """The tiny BERT captured with (input_ids, attention_mask), metadata, its Linears quantized to w4 / in6."""
    from fxforge import ForgeGraph, passes

    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    mg, _ = passes.quantize_transform_pass(mg, QUANT)
    return mg


def test_default_view_opens_on_the_model_layers(quantized: Any) -> None:
    from fxforge.report.hierarchy import build_hierarchy

    h = build_hierarchy(quantized)
    visible, stack = [], [h.root]
    while stack:
        item = h.items[stack.pop()]
        for c in item.children:
            (stack if c in h.expanded else visible).append(c)
    labels = {h.items[v].label for v in visible}
    assert {"embeddings", "layer.0", "layer.1", "pooler", "classifier", "input_ids"} <= labels, labels
    assert len(visible) <= 30
    assert all(h.items[v].kind == "group" for v in visible if h.items[v].label.startswith("layer."))
    leaves = [i for i in h.items.values() if i.kind == "node"]
    assert sorted(i.id[2:] for i in leaves) == sorted(n.name for n in quantized.nodes)  # every node once
    assert h.items["g:bert.encoder.layer.0.attention.self"].parent == "g:bert.encoder.layer.0.attention"
    assert h.items[QUERY].path == "bert.encoder.layer.0.attention.self.query"


def test_default_view_stays_within_its_box_budget(quantized: Any) -> None:
    from fxforge.report.hierarchy import _visible, build_hierarchy

    full = build_hierarchy(quantized)
    assert _visible(full.items, full.root, set(full.expanded)) > 8
    h = build_hierarchy(quantized, max_boxes=8)  # too few for the layers: their list stays closed
    assert "g:bert.encoder.layer" not in h.expanded and h.root in h.expanded
    assert _visible(h.items, h.root, set(h.expanded)) <= 8


def test_every_group_has_a_layered_layout_of_its_children(quantized: Any) -> None:
    from fxforge.report.hierarchy import build_hierarchy

    h = build_hierarchy(quantized)
    for group in h.groups():
        layout = group.layout
        assert layout is not None
        placed = [c for row in layout.rows for c in row]
        assert sorted(c for c in placed if not c.startswith("~")) == sorted(group.children), group.id
        layer = {c: k for k, row in enumerate(layout.rows) for c in row}
        for src, dst, bends in layout.routes:  # every edge runs between layers, one bend per layer crossed
            assert abs(layer[src] - layer[dst]) == len(bends) + 1, (group.id, src, dst)
        for row in layout.rows:  # boxes of a layer never overlap (one slot a box, a quarter for a bend)
            xs = [layout.x[c] for c in row]
            widths = [0.25 if c.startswith("~") else 1.0 for c in row]
            assert all(xs[k + 1] - xs[k] >= (widths[k] + widths[k + 1]) / 2 - 1e-9 for k in range(len(xs) - 1))


def test_layered_layout_removes_crossings_and_routes_long_edges() -> None:
    from fxforge.report.layered_layout import _total_crossings, layered_layout

    # a -> (c, b) crossed as given; d joins both; a -> d spans two layers
    layout = layered_layout(["a", "c", "b", "x", "d"], [("a", "b"), ("x", "c"), ("a", "d"), ("b", "d"), ("c", "d")])
    down: dict[str, list[str]] = {}
    for s, d, bends in layout.routes:
        chain = [s, *bends, d]
        for u, v in zip(chain, chain[1:], strict=False):
            down.setdefault(u, []).append(v)
    assert _total_crossings(layout.rows, down) == 0
    assert [r for r in layout.routes if r[:2] == ("a", "d")][0][2], "the long edge a -> d has a bend point"


def test_precision_overlay_shows_the_quantized_widths(quantized: Any) -> None:
    from fxforge.report.hierarchy import build_hierarchy

    h = build_hierarchy(quantized)
    query = h.items[QUERY]
    assert query.values["bits"] == 4 and query.info["precision"] == "integer in6 w4 b8", query.info
    assert h.items["g:bert.encoder.layer.0"].values["bits"] == 4  # a module shows its narrowest width
    norm = h.items["n:bert_encoder_layer_0_output_layer_norm"]
    assert norm.values["bits"] == 32 and norm.info["precision"] == "float32"
    assert "use_cache" not in " ".join(quantized.capture_notes)  # an encoder: no KV cache was turned off


def test_node_rows_precision_is_the_quantized_format(quantized: Any) -> None:
    from fxforge.report.rows import node_rows

    rows = {r.name: r for r in node_rows(quantized)}
    assert rows[QUERY[2:]].precision == "integer in6 w4 b8"  # was [32]: the fp32 carrier's width


def test_parameter_sparsity_and_sensitivity_overlays(quantized: Any) -> None:
    from fxforge.report.hierarchy import build_hierarchy, module_rows

    mg = quantized.copy()
    layer = mg.model.get_submodule("bert.encoder.layer.1.intermediate.dense")
    with torch.no_grad():
        layer.weight[: layer.weight.shape[0] // 4] = 0  # a quarter of the rows zeroed
    sens = {"method": "loss", "baseline_loss": 0.7, "layers": [
        {"name": "classifier", "params": 64, "quant": [[8, 0.01], [2, 0.4]]}]}
    h = build_hierarchy(mg, sensitivity=sens)
    assert h.items["n:bert_encoder_layer_1_intermediate_dense"].values["sparsity"] == pytest.approx(0.25)
    group = h.items["g:bert.encoder.layer.1"].values
    total = sum(m.weight.numel() for n, m in mg.model.named_modules()
                if n.startswith("bert.encoder.layer.1.") and getattr(m, "weight", None) is not None
                and m.weight.dim() >= 2)
    assert group["sparsity"] == pytest.approx(layer.weight.numel() / 4 / total)
    assert h.items[h.root].values["params"] == sum(p.numel() for p in mg.model.parameters())
    assert h.items["n:classifier"].values["sensitivity"] == 0.4  # the narrowest width's loss increase
    rows = {r.path: r for r in module_rows(h)}
    assert rows["bert.encoder.layer.1.intermediate.dense"].values["sparsity"] == pytest.approx(0.25)


def test_checkpoint_keeps_the_module_grouping(quantized: Any, tmp_path: Path) -> None:
    from fxforge import ForgeGraph
    from fxforge.report.hierarchy import build_hierarchy

    quantized.export(tmp_path / "ckpt")
    h = build_hierarchy(ForgeGraph.from_checkpoint(tmp_path / "ckpt"))
    assert h.items[QUERY].path == "bert.encoder.layer.0.attention.self.query"
    assert h.items[QUERY].parent == "g:bert.encoder.layer.0.attention.self"
    assert h.items[QUERY].values["bits"] == 4


def view_of(mg: Any) -> dict[str, tuple[str, str | None, str, str, str]]:
    """Every box of the view: (kind, parent group, module path, label, module class)."""
    from fxforge.report.hierarchy import build_hierarchy

    h = build_hierarchy(mg)
    return {i.id: (i.kind, i.parent, i.path, i.label, i.info.get("module", "")) for i in h.items.values()}


def assert_reload_keeps_the_view(mg: Any, tmp_path: Path) -> None:
    """``mg`` reloaded from its checkpoint (and from that graph's own checkpoint) has every node's module path
    and the same view: the checkpoint keeps the capture's module stacks, so nothing is inferred."""
    from fxforge import ForgeGraph
    from fxforge.report.hierarchy import build_hierarchy, module_paths

    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt"))
    live_paths, loaded_paths = module_paths(mg), module_paths(loaded)
    off = {n: (p, loaded_paths[n]) for n, p in live_paths.items() if loaded_paths[n] != p}
    assert not off, f"{len(off)} of {len(live_paths)} nodes change module: {sorted(off.items())[:5]}"
    live = view_of(mg)
    assert view_of(loaded) == live  # same group, parent, label and module class for every node and group
    assert build_hierarchy(loaded).expanded == build_hierarchy(mg).expanded
    again = ForgeGraph.from_checkpoint(loaded.export(tmp_path / "again"))  # a reloaded graph saves them again
    assert view_of(again) == live


def test_reloaded_bert_checkpoint_has_the_live_view(quantized: Any, tmp_path: Path) -> None:
    assert_reload_keeps_the_view(quantized, tmp_path)  # 18 of 102 nodes were one level off when inferred


def test_reloaded_gpt_checkpoint_has_the_live_view(tmp_path: Path) -> None:
    from fxforge import ForgeGraph

    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8))).eval()
    assert_reload_keeps_the_view(mg, tmp_path)  # the fx frontend's stacks: 38 of 141 nodes were off


def test_hostile_names_stay_data(quantized: Any) -> None:
    from fxforge.report import build_report
    from fxforge.report.graph_view import graph_view_html

    mg = quantized.copy()
    evil = "</script><img src=x onerror=alert(1)>\"'é\u2028"
    for node in mg.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack and "layer.1.output" in str(list(stack.values())[-1][0]):
            key, (path, typ) = list(stack.items())[-1]
            stack[key] = (path.replace("layer.1.output", f"layer.1.{evil}"), typ)
    next(n for n in mg.nodes if n.op == "call_function").name = evil
    report = build_report(mg)
    assert "use_cache" not in report
    for html in (report, graph_view_html(mg, "v1")):
        assert "<img src=x" not in html and "</script><b" not in html
        assert html.count("</script>") == html.count("<script")  # only the page's own elements close
        data = re.search(r'<script type="application/json" class="fxg-data">(.*?)</script>', html, re.S)
        assert data is not None
        view = json.loads(data.group(1))
        assert any(evil in item["path"] for item in view["items"].values())
        assert any(item["info"].get("node") == evil for item in view["items"].values())
    with pytest.raises(ValueError, match="graph view id"):
        graph_view_html(mg, 'x" onload="alert(1)')
