"""MASE's metadata passes on tiny BERT at two shapes: software entries, verify (every mismatch reported),
the three node reports, and streamed per-node statistics equal to the same statistics computed directly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, bert_metadata_graph

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.analysis.software_metadata import SoftwareEntriesRecord
from fxforge.passes.analysis.statistics import StatisticsRecord

SHAPES = [(2, 8), (3, 11)]
QUERY = "bert_encoder_layer_0_attention_self_query"
QUERY_PATH = "bert.encoder.layer.0.attention.self.query"


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    return bert_metadata_graph()


def at_shape(base: ForgeGraph, shape: tuple[int, int]) -> tuple[ForgeGraph, dict[str, torch.Tensor]]:
    """A copy of the graph whose metadata was recorded at ``shape`` (batch, sequence length)."""
    x = bert_inputs(labels=False, batch=shape[0], seq=shape[1])
    mg, _ = passes.add_common_metadata_analysis_pass(base.copy(), {"dummy_in": x})
    return mg, x


@pytest.mark.parametrize("shape", SHAPES)
def test_verify_reports_every_corrupted_entry(base: ForgeGraph, shape: tuple[int, int]) -> None:
    mg, x = at_shape(base, shape)
    _, info = passes.verify_common_metadata_analysis_pass(mg, {"dummy_in": x})
    assert info.ok and info.nodes == len(mg.model.graph.nodes) and not info.mismatches
    query = get_meta(mg.node(QUERY)).common
    good = query.results["data_out_0"]
    query.results["data_out_0"] = dataclasses.replace(good, shape=(shape[0], shape[1], 99))
    classifier = get_meta(mg.node("classifier")).common
    classifier.args["weight"] = dataclasses.replace(classifier.args["weight"], dtype="float16")
    _, info = passes.verify_common_metadata_analysis_pass(mg, {"dummy_in": x, "raise_on_mismatch": False})
    assert not info.ok
    assert sorted((m.node, m.where, m.recorded, m.expected) for m in info.mismatches) == [
        (QUERY, "common.results.data_out_0.shape", [shape[0], shape[1], 99], [shape[0], shape[1], 32]),
        ("classifier", "common.args.weight.dtype", "float16", "float32"),
    ]
    with pytest.raises(PassError, match=rf"(?s)2 metadata mismatch.*{QUERY}.*classifier"):
        passes.verify_metadata_analysis_pass(mg, {"dummy_in": x})


def test_metadata_of_another_shape_is_reported_node_by_node(base: ForgeGraph) -> None:
    mg, _ = at_shape(base, SHAPES[0])
    other = bert_inputs(labels=False, batch=SHAPES[1][0], seq=SHAPES[1][1])
    _, info = passes.verify_common_metadata_analysis_pass(mg, {"dummy_in": other, "raise_on_mismatch": False})
    shape_errors = {m.node for m in info.mismatches if m.where.endswith(".shape")}
    assert QUERY in shape_errors and "input_ids" in shape_errors
    assert all(m.node in {n.name for n in mg.nodes} for m in info.mismatches)


def test_software_metadata_entries_and_verify(base: ForgeGraph) -> None:
    mg, x = at_shape(base, SHAPES[1])
    mg, info = passes.add_software_metadata_analysis_pass(mg)
    entries = get_meta(mg.node(QUERY)).software.get(SoftwareEntriesRecord)
    assert entries == SoftwareEntriesRecord(args=("data_in_0", "weight", "bias"), results=("data_out_0",))
    layer_norm = get_meta(mg.node("bert_embeddings_layer_norm")).software.get(SoftwareEntriesRecord)
    assert layer_norm is not None and layer_norm.args == ("data_in_0", "weight", "bias")
    assert info.nodes == len(mg.model.graph.nodes) and info.entries > 3 * 14
    _, ok = passes.verify_metadata_analysis_pass(mg, {"dummy_in": x})
    assert ok.ok
    get_meta(mg.node(QUERY)).software.set(SoftwareEntriesRecord(args=("data_in_0",), results=("data_out_0",)))
    get_meta(mg.node("classifier")).software.set(StatisticsRecord(stats={
        "weight": {"range_min_max": {"min": 1.0, "max": -1.0, "range": -2.0, "count": 4}},
        "data_in_7": {"abs_mean": {"abs_mean": float("nan"), "count": 0}}}))
    _, info = passes.verify_software_metadata_analysis_pass(mg, {"raise_on_mismatch": False})
    assert {(m.node, m.where) for m in info.mismatches} == {
        (QUERY, "software.entries.args"),
        ("classifier", "software.statistics.weight.range_min_max.min"),
        ("classifier", "software.statistics.data_in_7"),
        ("classifier", "software.statistics.data_in_7.abs_mean.abs_mean"),
    }


@pytest.mark.parametrize("shape", SHAPES)
def test_node_reports_have_mases_content(base: ForgeGraph, shape: tuple[int, int], tmp_path: Path) -> None:
    mg, _ = at_shape(base, shape)
    _, types = passes.report_node_type_analysis_pass(mg, {"show": False})
    row = next(r for r in types.rows if r["node"] == QUERY)
    assert row == {"node": QUERY, "fx_op": "call_module", "mase_type": "module_related_func", "mase_op": "linear",
                   "value_type": "float32"}
    assert len(types.rows) == len(mg.model.graph.nodes) and QUERY in types.text
    _, shapes = passes.report_node_shape_analysis_pass(mg, {"show": False})
    b, s = shape
    assert shapes.shapes[QUERY] == {"in": {"data_in_0": [b, s, 32], "weight": [32, 32], "bias": [32]},
                                    "out": {"data_out_0": [b, s, 32]}}
    listed = (f"{QUERY}:\nin:\ndata_in_0 = [{b}, {s}, 32]\nweight = [32, 32]\nbias = [32]\n"
              f"out:\ndata_out_0 = [{b}, {s}, 32]")
    assert listed in shapes.text
    out = tmp_path / "report" / "meta.txt"
    _, meta = passes.report_node_meta_param_analysis_pass(mg, {"which": ["common"], "save_path": str(out),
                                                               "show": False})
    row = next(r for r in meta.rows if r["node"] == QUERY)
    assert set(row) == {"node", "fx_op", "mase_type", "mase_op", "common"}
    assert row["common"]["results"]["data_out_0"]["shape"] == [b, s, 32]
    assert out.read_text().startswith("node") and QUERY in out.read_text()
    with pytest.raises(PassArgsError, match="which"):
        passes.report_node_meta_param_analysis_pass(mg, {"which": ["everything"]})


def _query_inputs(mg: ForgeGraph, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Every value the query projection sees over ``batches``, recorded by a hook on its module."""
    seen: list[torch.Tensor] = []
    handle = mg.model.get_submodule(QUERY_PATH).register_forward_hook(lambda m, a, o: seen.append(a[0].flatten()))
    with torch.no_grad():
        for batch in batches:
            mg(**batch)
    handle.remove()
    return torch.cat(seen).double()


def test_profile_statistics_equal_direct_computation_over_batches_of_two_shapes(base: ForgeGraph) -> None:
    mg = base.copy()
    batches = [bert_inputs(labels=False, batch=b, seq=s) for b, s in SHAPES]
    mg, info = passes.profile_statistics_analysis_pass(mg, {
        "by": "type", "target_weight_nodes": ["linear"], "target_activation_nodes": "linear",
        "weight_statistics": {"range_min_max": {}, "variance_precise": {"device": "cpu", "dims": "all"}},
        "activation_statistics": {"range_min_max": {}, "variance_online": {}, "range_quantile": {"quantile": 0.9},
                                  "abs_mean": {}, "range_n_sigma": {"num_sigma": 2}},
        "input_generator": batches, "profile_output_activation": True})
    assert (info.batches, info.samples) == (2, 5) and QUERY in info.weight_nodes and len(info.activation_nodes) == 14
    weight = mg.model.get_submodule(QUERY_PATH).weight.detach().double()
    w = info.stat(QUERY, "weight", "range_min_max")
    assert (w["min"], w["max"], w["count"]) == (weight.min().item(), weight.max().item(), weight.numel())
    var = info.stat(QUERY, "weight", "variance_precise")
    assert var["mean"] == pytest.approx(weight.mean().item(), rel=1e-9, abs=1e-12)
    assert var["variance"] == pytest.approx(weight.var(unbiased=False).item(), rel=1e-9)
    act = _query_inputs(mg, batches)
    stats = info.stats[QUERY]["data_in_0"]
    assert stats["range_min_max"]["min"] == act.min().item() and stats["range_min_max"]["count"] == act.numel()
    assert stats["variance_online"]["variance"] == pytest.approx(act.var(unbiased=False).item(), rel=1e-9)
    assert stats["abs_mean"]["abs_mean"] == pytest.approx(act.abs().mean().item(), rel=1e-9)
    q = stats["range_quantile"]
    assert q["exact"] == 1 and q["count"] == act.numel()
    assert (q["min"], q["max"]) == pytest.approx((act.quantile(0.1).item(), act.quantile(0.9).item()), rel=1e-12)
    sigma = act.var(unbiased=False).sqrt().item()
    assert stats["range_n_sigma"]["max"] == pytest.approx(act.mean().item() + 2 * sigma, rel=1e-9)
    assert set(info.stats[QUERY]) == {"weight", "bias", "data_in_0", "data_out_0"}
    record = get_meta(mg.node(QUERY)).software.get(StatisticsRecord)
    assert record is not None and record.stats == info.stats[QUERY]
    mg, _ = passes.add_software_metadata_analysis_pass(mg)
    _, ok = passes.verify_software_metadata_analysis_pass(mg)
    assert ok.ok  # the statistics sit on the node's own entries


def test_profile_statistics_streams_bounded_and_stops_at_num_samples(base: ForgeGraph) -> None:
    batches = iter([bert_inputs(labels=False, batch=b, seq=8) for b in (2, 3, 2)])
    _, info = passes.profile_statistics_analysis_pass(base.copy(), {
        "target_activation_nodes": ["gelu"], "num_samples": 4,
        "activation_statistics": {"range_quantile": {"quantile": 0.99, "capacity": 100}, "range_min_max": {}},
        "data": batches})
    assert (info.batches, info.samples) == (2, 5) and next(batches)["input_ids"].shape[0] == 2  # third never read
    node = info.activation_nodes[0]
    q, mm = info.stat(node, "data_in_0", "range_quantile"), info.stat(node, "data_in_0", "range_min_max")
    assert q["exact"] == 0 and q["count"] == mm["count"] == 5 * 8 * 64
    assert mm["min"] <= q["min"] < q["max"] <= mm["max"]


def test_profile_statistics_refuses_what_it_does_not_stream(base: ForgeGraph) -> None:
    with pytest.raises(PassArgsError, match="'record' keeps every value"):
        passes.profile_statistics_analysis_pass(base, {"target_weight_nodes": ["linear"],
                                                       "weight_statistics": {"record": {}}})
    with pytest.raises(PassArgsError, match="dims"):
        passes.profile_statistics_analysis_pass(base, {"target_weight_nodes": ["linear"],
                                                       "weight_statistics": {"range_min_max": {"dims": [0]}}})
    with pytest.raises(PassError, match="no node matches.*ops in this graph"):
        passes.profile_statistics_analysis_pass(base, {"target_weight_nodes": ["conv2d"]})
    with pytest.raises(PassError, match="iterator.*num_samples"):
        passes.profile_statistics_analysis_pass(base, {"target_activation_nodes": ["gelu"], "data": iter([])})
