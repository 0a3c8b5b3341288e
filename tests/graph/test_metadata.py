"""Typed metadata: kinds, canonical ops, shapes/dtypes (complex too), JSON round trip."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from conftest import make_agru, make_gpt

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import (
    MetaRecord,
    MetaSection,
    NodeKind,
    NodeMeta,
    ValueMeta,
    dtype_precision,
    get_meta,
    register_record,
)


@dataclass
class _Note(MetaRecord):
    text: str = ""
    widths: tuple[int, ...] = ()


def _with_metadata(mg: ForgeGraph) -> ForgeGraph:
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def test_bert_metadata_kinds_ops_and_shapes(tiny_bert: nn.Module) -> None:
    mg = _with_metadata(ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"]))
    query = mg.meta(next(n for n in mg.nodes if n.target == "bert.encoder.layer.0.attention.self.query"))
    assert query.common.kind is NodeKind.MODULE_RELATED_FUNC and query.common.op == "linear"
    assert query.common.module_type == "torch.nn.modules.linear.Linear"
    assert query.common.args["data_in_0"].shape == (2, 16, 32)
    assert query.common.args["weight"].shape == (32, 32) and query.common.args["weight"].requires_grad
    assert query.common.results["data_out_0"] == ValueMeta(
        type="tensor", shape=(2, 16, 32), dtype="float32", precision=(32,))
    kinds = {get_meta(n).common.kind for n in mg.nodes}
    assert {NodeKind.PLACEHOLDER, NodeKind.GET_ATTR, NodeKind.OUTPUT, NodeKind.BUILTIN_FUNC,
            NodeKind.MODULE_RELATED_FUNC} <= kinds
    ops = {get_meta(n).common.op for n in mg.nodes}
    assert {"embedding", "layer_norm", "dropout", "gelu", "add", "view", "scaled_dot_product_attention",
            "cross_entropy_loss"} <= ops
    out = get_meta(next(n for n in mg.nodes if n.op == "output")).common
    assert out.args["data_in_0"].shape == () and out.args["data_in_1"].shape == (2, 2)  # loss, logits


def test_afno_complex_dtypes_in_metadata() -> None:
    mg = _with_metadata(ForgeGraph(make_gpt("afno"), example_inputs=torch.randint(0, 64, (2, 16))))
    rfft = [n for n in mg.nodes if get_meta(n).common.op == "fft_rfft"]
    assert rfft, "the AFNO mixer's rfft must be a node"
    res = get_meta(rfft[0]).common.results["data_out_0"]
    assert res.dtype == "complex64" and res.precision == (32, 32)
    assert any(get_meta(n).common.op == "fft_irfft" for n in mg.nodes)


def test_canonical_ops_agree_across_frontends() -> None:
    model = make_gpt("attn")
    idx = torch.randint(0, 64, (2, 16))
    by_frontend = {}
    for frontend in ("fx", "export"):
        mg = _with_metadata(ForgeGraph(model, example_inputs=idx, frontend=frontend))
        ops = [get_meta(n).common.op for n in mg.nodes]
        by_frontend[frontend] = {op: ops.count(op) for op in ("linear", "layer_norm", "embedding", "gelu",
                                                              "scaled_dot_product_attention")}
    assert by_frontend["fx"] == by_frontend["export"]
    assert by_frontend["fx"]["linear"] == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert by_frontend["fx"]["scaled_dot_product_attention"] == 2


def test_metadata_on_export_fallback_model() -> None:
    x = torch.randn(3, 8, 8)
    mg = _with_metadata(ForgeGraph(make_agru(), example_inputs=x))
    head = mg.meta(next(n for n in mg.nodes if n.target == "head"))
    assert head.common.results["data_out_0"].shape == (3, 10)


def test_dummy_in_overrides_and_missing_inputs_error() -> None:
    model = make_gpt("attn")
    mg = ForgeGraph(model)  # fx needs no inputs to capture...
    with pytest.raises(passes.PassError, match="dummy_in"):
        passes.add_common_metadata_analysis_pass(mg)  # ...but shape propagation does
    mg, _ = passes.add_common_metadata_analysis_pass(mg, {"dummy_in": torch.randint(0, 64, (1, 5))})
    assert mg.meta("lm_head").common.results["data_out_0"].shape == (1, 5, 64)


@pytest.mark.usefixtures("restore_registries")
def test_metadata_json_round_trip_with_records() -> None:
    register_record("test.note")(_Note)
    mg = _with_metadata(ForgeGraph(make_gpt("afno"), example_inputs=torch.randint(0, 64, (2, 8))))
    for node in mg.nodes:
        get_meta(node).software.set(_Note(text=node.name, widths=(8, 4)))
        restored = NodeMeta.from_json(get_meta(node).to_json())
        assert restored == get_meta(node)
    rec = mg.meta("lm_head").software.get(_Note)
    assert rec is not None and rec.widths == (8, 4)


def test_unregistered_record_and_missing_metadata_errors(tiny_bert: nn.Module) -> None:
    @dataclass
    class Loose(MetaRecord):
        x: int = 0

    with pytest.raises(TypeError, match="registered"):
        MetaSection().set(Loose())

    class NotADataclass(MetaRecord):  # MetaRecord declares __dataclass_fields__ for the type checker only
        x: int = 0

    with pytest.raises(TypeError, match="NotADataclass must be a dataclass"):
        register_record("test.not_a_dataclass")(NotADataclass)
    with pytest.raises(ValueError, match="unknown metadata record"):
        MetaSection.from_json({"nope": {}})
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(LookupError, match="init_metadata_analysis_pass"):
        mg.meta(next(iter(mg.nodes)))


def test_dtype_precision() -> None:
    assert dtype_precision(torch.float32) == (32,)
    assert dtype_precision(torch.bfloat16) == (16,)
    assert dtype_precision(torch.complex64) == (32, 32)
    assert dtype_precision(torch.bool) == (1,)
    assert ValueMeta.of(float("inf")).value == "inf"
    assert ValueMeta.of(None).type == "none"
