"""The memory timeline (report/memory_timeline.py) and its report section: the curves recomputed from the
liveness records peak where liveness_analysis_pass says, survive a checkpoint, and the report draws them
(inline SVG) only when liveness ran, with hostile node names escaped and bad records refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bert_metadata_graph, make_gpt

from fxforge import ForgeGraph, passes
from fxforge.passes.analysis.liveness import LivenessRecord
from fxforge.report import build_report
from fxforge.report.memory_timeline import memory_timeline


@pytest.fixture(scope="module")
def bert_liveness() -> tuple[Any, Any]:
    """The tiny BERT after the metadata passes and liveness_analysis_pass, with the pass's info."""
    mg = bert_metadata_graph()
    mg, info = passes.liveness_analysis_pass(mg)
    return mg, info


def test_curves_peak_at_the_pass_estimates_on_tiny_bert(bert_liveness: tuple[Any, Any]) -> None:
    mg, info = bert_liveness
    tl = memory_timeline(mg)
    assert tl is not None and len(tl.inference) == len(tl.training) == len(list(mg.model.graph.nodes))
    assert max(tl.inference) == tl.peak_inference_bytes == info.peak_inference_bytes
    assert max(tl.training) == tl.peak_training_bytes == info.peak_training_bytes
    assert tl.nodes[tl.peak_inference] == info.peak_inference_node
    assert tl.nodes[tl.peak_training] == info.peak_training_node
    assert all(t >= i for t, i in zip(tl.training, tl.inference))  # training keeps at least what inference does
    assert tl.training[-1] > tl.inference[-1]  # saved activations are still alive at the end of the forward
    at = tl.at_inference_peak
    assert at and [b.bytes for b in at] == sorted((b.bytes for b in at), reverse=True)
    assert all(b.born <= tl.peak_inference <= b.dies for b in at)
    assert sum(b.bytes for b in at) <= tl.peak_inference_bytes


def test_curves_peak_at_the_pass_estimates_on_the_gpt() -> None:
    """Attention's op-internal saved tensors (kept in the records' ``others``) are counted too."""
    mg = ForgeGraph(make_gpt("attn"), (torch.randint(0, 64, (2, 32)),))
    passes.init_metadata_analysis_pass(mg)
    assert memory_timeline(mg) is None  # no liveness yet
    _, info = passes.liveness_analysis_pass(mg)
    tl = memory_timeline(mg)
    assert tl is not None
    assert (tl.peak_inference_bytes, tl.peak_training_bytes) == (info.peak_inference_bytes, info.peak_training_bytes)


def test_report_draws_the_timeline_only_when_liveness_ran(bert_liveness: tuple[Any, Any]) -> None:
    mg, info = bert_liveness
    html = build_report(mg)
    assert html.count('<svg id="memory-timeline"') == 1
    assert 'class="curve-training"' in html and 'class="curve-inference"' in html
    assert f"at node {[n.name for n in mg.nodes].index(info.peak_training_node)} {info.peak_training_node}" in html
    assert 'id="memory-peak"' in html and "<script src" not in html and "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: nothing fetched
    plain = build_report(bert_metadata_graph())
    assert "memory-timeline" not in plain and "No liveness metadata" in plain


def test_checkpoint_keeps_the_timeline(bert_liveness: tuple[Any, Any], tmp_path: Path) -> None:
    """`fxforge report CKPT` reads a checkpoint: its records (``others`` included) give the same curves."""
    mg, _ = bert_liveness
    loaded = ForgeGraph.from_checkpoint(mg.copy().export(tmp_path / "ckpt"))
    assert memory_timeline(loaded) == memory_timeline(mg)


def test_hostile_node_name_is_escaped(bert_liveness: tuple[Any, Any]) -> None:
    mg = bert_liveness[0].copy()
    tl = memory_timeline(mg)
    assert tl is not None
    peak = list(mg.model.graph.nodes)[tl.peak_training]
    peak.name = "</script><b>"
    html = build_report(mg, title="t")
    section = html[html.index("<section id='memory'>"):html.index("<section id='deploy'>")]
    assert "</script><b>" not in html and "<b></script>" not in html
    assert section.count("&lt;/script&gt;&lt;b&gt;") >= 3  # the summary, the peak's label and its tooltip


def test_a_stale_or_malformed_record_is_refused_not_drawn(bert_liveness: tuple[Any, Any]) -> None:
    mg = bert_liveness[0].copy()
    node = next(n for n in mg.nodes if mg.meta(n).software.get(LivenessRecord) is not None)
    rec = mg.meta(node).software.get(LivenessRecord)
    index = list(mg.nodes).index(node)
    rec.born = rec.dies = index + 1  # born after the node itself: the graph changed since the pass ran
    with pytest.raises(ValueError, match="does not match the graph"):
        memory_timeline(mg)
    assert "Memory timeline not shown" in build_report(mg) and "memory-timeline" not in build_report(mg)
    rec.born, rec.dies, rec.others = index, index, [[index, index, "10", 3, True]]
    with pytest.raises(ValueError, match="bytes must be an integer"):
        memory_timeline(mg)
