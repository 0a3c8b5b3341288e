"""The inference signature: labels and loss dropped from a copy, the shape guard's proven ranges turned into
torch.export dims (batch 1 accepted, the sequence bound kept), axes the guard fixes reported static."""

from __future__ import annotations

import pytest
import torch
from conftest import bert_inputs, make_gpt, make_tiny_bert
from hf_tiny import INPUT_NAMES, hf_inputs, tiny_hf

from fxforge import ForgeGraph
from fxforge.deploy.manifest import AxisRange
from fxforge.deploy.signature import export_program, inference_signature, manifest_axes
from fxforge.graph.guards import check_input_shapes


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()


def test_labels_and_loss_dropped_from_a_copy(bert: ForgeGraph) -> None:
    code = bert.model.code
    sig = inference_signature(bert)
    assert bert.model.code == code  # the caller's graph keeps its labels, loss and guard
    assert sig.input_names == ("input_ids", "attention_mask") and sig.output_names == ("logits",)
    assert set(sig.example_inputs) == {"input_ids", "attention_mask"}
    targets = {str(n.target) for n in sig.module.graph.nodes}
    assert not any("cross_entropy" in t or "nll_loss" in t for t in targets), targets
    assert not any(n.target is check_input_shapes for n in sig.module.graph.nodes)
    assert sig.ranges == {("input_ids", 1): (2, 64)} and sig.fixed == {}  # the guard's proven sequence range
    x = bert_inputs(batch=3, seq=11)
    with torch.no_grad():
        want = bert(**x).logits
    assert torch.equal(sig({k: v for k, v in x.items() if k != "labels"})["logits"], want)


def test_dynamic_axes_from_the_guard_and_batch_one(bert: ForgeGraph) -> None:
    program = export_program(inference_signature(bert), dynamic_batch=True, dynamic_seq=True)
    assert program.dynamic_axes == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert program.axis_ranges[("input_ids", 0)] == (1, None)  # no guard on the batch: 1 asked and accepted
    assert program.axis_ranges[("input_ids", 1)] == (2, 64)  # the guard's proven range, not widened to 1
    assert program.static == ()
    assert program.output_axes == {"logits": {0: ("input_ids", 0)}}  # logits' batch follows the input's
    labels, ranges = manifest_axes(program)
    assert labels["logits"] == {0: "batch"} and ranges["logits"] == {0: AxisRange(1, None, "input_ids[0]")}
    assert ranges["attention_mask"] == {0: AxisRange(1, None), 1: AxisRange(2, 64)}
    assert not any("check_input_shapes" in str(n.target) for n in program.program.graph.nodes)
    run = program.program.module()
    for batch, seq in ((1, 7), (1, 64), (4, 2)):
        x = bert_inputs(batch=batch, seq=seq, labels=False)
        with torch.no_grad():
            (got,) = run(x["input_ids"], x["attention_mask"])
        assert torch.allclose(got, program.signature(x)["logits"], rtol=0, atol=1e-6), (batch, seq)
    x = bert_inputs(batch=2, seq=65, labels=False)
    with pytest.raises(Exception, match="65|range|<= 64"):
        run(x["input_ids"], x["attention_mask"])


def test_axes_not_asked_stay_static(bert: ForgeGraph) -> None:
    program = export_program(inference_signature(bert), dynamic_batch=False, dynamic_seq=False)
    assert program.dynamic_axes == {} and program.static == ()
    only_seq = export_program(inference_signature(bert), dynamic_batch=False, dynamic_seq=True)
    assert only_seq.dynamic_axes == {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}


def test_axes_the_guard_fixes_are_static_and_reported() -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"], dynamic=False).eval()
    sig = inference_signature(mg)
    assert ("input_ids", 0) in sig.fixed and ("input_ids", 1) in sig.fixed
    program = export_program(sig, dynamic_batch=True, dynamic_seq=True)
    assert program.dynamic_axes == {}
    assert len(program.static) == 4 and all("dynamic=False" in why for why in program.static), program.static


def test_fx_gpt_sequence_bound_proven_by_torch_export() -> None:
    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 16))).eval()
    sig = inference_signature(mg)
    assert sig.input_names == ("idx",) and sig.output_names == ("output_0",) and sig.ranges == {}
    program = export_program(sig, dynamic_batch=True, dynamic_seq=True)
    assert program.dynamic_axes == {"idx": {0: "batch", 1: "seq"}}
    assert program.axis_ranges[("idx", 1)] == (1, 32)  # the model's sequence_length, from its rotary tables
    assert program.output_axes == {"output_0": {0: ("idx", 0), 1: ("idx", 1)}}
    idx = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        (got,) = program.program.module()(idx)
        assert torch.allclose(got, mg(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_guards_on_labels_do_not_fix_inference_axes(family: str) -> None:
    """GPT-2's capture guards ``mask batch * mask len == labels len * labels batch`` (the loss's reshape); ViT's
    program reads its batch size from ``labels``. Neither keeps an inference axis static or needs labels."""
    mg = ForgeGraph(tiny_hf(family), hf_input_names=INPUT_NAMES[family]).eval()
    program = export_program(inference_signature(mg), dynamic_batch=True, dynamic_seq=True)
    names = program.signature.input_names
    assert "labels" not in names and program.static == ()
    assert all(program.dynamic_axes[n].get(0) == "batch" for n in names), program.dynamic_axes
    for batch, seq in ((1, 7), (3, 11)):
        x = hf_inputs(family, batch, 32 if family == "vit" else seq)
        with torch.no_grad():
            (got,) = program.program.module()(*(x[n] for n in names))
            assert torch.allclose(got, mg(**x).logits, rtol=0, atol=1e-5), (family, batch, seq)
