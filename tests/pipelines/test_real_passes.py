"""Pipelines of the real passes on tiny BERT: contracts measured, replay from a reloaded checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.pipelines import CompressionPipeline, Pipeline, PipelineError
from fxforge.pipelines.presets import DYNAMIC_INT8, SCALED_INT8

HF = ["input_ids", "attention_mask"]


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    """Captured once per module: pipelines run on copies, and tests check the input stays untouched."""
    return ForgeGraph(make_tiny_bert(), hf_input_names=HF)


def _max_diff(a: Any, b: Any) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)))


def test_int8_preset_checks_contracts_and_defers_until_calibrated(bert: ForgeGraph) -> None:
    mg = bert
    ref = mg(**bert_inputs(labels=False))
    out, report = Pipeline.preset("int8-fast")(mg)
    assert [s.name for s in report.steps] == ["remove_dropout_transform_pass", "quantize_transform_pass",
                                              "calibrate_transform_pass", "lower_int8_transform_pass"]
    assert report[0].contract.kind == "exact" and report[0].contract.max_abs == 0.0
    assert report[0].info.to_json()["removed"] == report[0].info.removed > 0
    assert _max_diff(mg(**bert_inputs(labels=False)), ref) == 0.0  # the input graph is untouched
    # static activation scales: the quantized graph runs only once calibrated, so quantize's bounded
    # contract is judged jointly with calibration's, against the outputs before quantization
    assert report[1].contract.kind == "deferred" and "not calibrated" in report[1].contract.violation
    joint = report[2].contract
    assert joint.kind == "bounded" and joint.covers == (2, 3) and math.isfinite(joint.sqnr_db) and joint.sqnr_db > 0
    assert report[3].contract.kind == "bounded" and report[3].contract.covers == (4,)
    assert report.check_forwards == 4 == len(report)  # a baseline, then one "after" per step whose graph ran
    assert out.history[0].args["name"] == "int8-fast"


def test_replay_from_a_reloaded_checkpoint_reproduces_it(bert: ForgeGraph, tmp_path: Path) -> None:
    mg = bert
    export = {"pass": "export", "args": {"path": str(tmp_path / "ck")}}
    steps = [*Pipeline.preset("int8-fast").to_dict()["steps"], export]
    out, report = Pipeline(steps, name="int8+export")(mg)
    assert report[-1].info.path == str(tmp_path / "ck")
    mg2 = ForgeGraph.from_checkpoint(tmp_path / "ck")
    replay = Pipeline.from_history(mg2)
    assert [s.name for s in replay.steps] == ["remove_dropout_transform_pass", "quantize_transform_pass",
                                              "calibrate_transform_pass", "lower_int8_transform_pass"]
    again, _ = replay(mg)
    for shape in ((3, 11), (2, 7)):
        x = bert_inputs(batch=shape[0], seq=shape[1], labels=False)
        assert _max_diff(again(**x), mg2(**x)) <= 1e-6
        assert _max_diff(out(**x), mg2(**x)) <= 1e-6
    # passes run by hand before a pipeline are replayed too (or skipped when the base already has them)
    from fxforge import passes

    base, _ = passes.init_metadata_analysis_pass(bert.copy())
    done, _ = Pipeline(["remove_dropout_transform_pass", ("quantize_transform_pass", DYNAMIC_INT8)])(base)
    full = Pipeline.from_history(done)
    assert [s.name for s in full.steps][0] == "init_metadata_analysis_pass" and len(full) == 3
    assert len(Pipeline.from_history(done, base=base)) == 2


def test_impossible_orders_of_real_passes_are_refused(bert: ForgeGraph) -> None:
    mg = bert
    with pytest.raises(PipelineError, match=r"impossible order: step 1 \(lower_int8_transform_pass\) requires "
                                            r"'quantized'.*run .*quantize_transform_pass first"):
        Pipeline(["lower_int8_transform_pass", ("quantize_transform_pass", DYNAMIC_INT8)])(mg)
    with pytest.raises(PipelineError, match=r"step 1 \(fuse_lora_weights_transform_pass\) requires 'lora'"):
        Pipeline(["fuse_lora_weights_transform_pass", "insert_lora_adapter_transform_pass"])(mg)
    with pytest.raises(PipelineError, match=r"step 2 \(quantize_transform_pass\) cannot run on a graph where "
                                            r"'quantized' holds"):
        Pipeline([("quantize_transform_pass", DYNAMIC_INT8), ("quantize_transform_pass", SCALED_INT8)])(mg)
    assert mg.history == []


def test_data_args_are_not_replayable(bert: ForgeGraph) -> None:
    mg = bert
    batches = [bert_inputs(labels=False)]
    steps = [("quantize_transform_pass", SCALED_INT8), ("calibrate_analysis_pass", {"data": batches})]
    out, _ = Pipeline(steps)(mg)
    assert out.history[0].args["steps"][1]["replayable"] is False
    with pytest.raises(PipelineError, match=r"step 'calibrate_transform_pass' used args that are not plain JSON"):
        Pipeline.from_history(out)


def test_same_pipeline_twice_on_the_same_input_gives_the_same_graph(bert: ForgeGraph) -> None:
    mg = bert
    pipe = Pipeline.preset("int8-fast")
    a, _ = pipe(mg)
    b, _ = pipe(mg)
    x = bert_inputs(labels=False)
    assert _max_diff(a(**x), b(**x)) == 0.0
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    assert [r.to_json() for r in a.history] == [r.to_json() for r in b.history]


def test_compression_pipeline_runs_in_the_standard_order(bert: ForgeGraph) -> None:
    pipe = CompressionPipeline(contracts={"quantize_transform_pass": {"min_sqnr_db": 5.0}})
    args = {"lower_int8_transform_pass": {}, "quantize_transform_pass": DYNAMIC_INT8}  # listed out of order
    out, report = pipe(bert, pass_args=args)
    assert [s.name for s in report.steps] == ["quantize_transform_pass", "lower_int8_transform_pass"]
    assert report[0].contract.kind == "bounded" and report[0].contract.ok and report[0].contract.sqnr_db > 5
    pruned, report = pipe(bert, pass_args={**args, "prune_transform_pass": {"weight": {"sparsity": 0.5}}})
    assert [s.name for s in report.steps] == ["prune_transform_pass", "quantize_transform_pass",
                                              "lower_int8_transform_pass"]
    assert report[0].contract.kind == "bounded" and report[0].info.sparsity == pytest.approx(0.5, abs=0.01)
    with pytest.raises(PipelineError, match=r"unknown pass_args key\(s\) \['sparsity'\]"):
        pipe(bert, pass_args={"prune_transform_pass": {"sparsity": 0.5}, **args})  # MASE's shape: weight/activation
    with pytest.raises(PipelineError, match=r"unknown pass_args key\(s\) \['quantise_transform_pass'\]"):
        pipe(bert, pass_args={"quantise_transform_pass": {}})
    with pytest.raises(PipelineError, match=r"step 1 \(quantize_transform_pass\): invalid args"):
        pipe(bert, pass_args={"quantize_transform_pass": {"by": "colour"}})


@pytest.fixture(scope="module")
def tiny_data() -> tuple[dict, object]:
    from fxforge.data import get_tokenized_dataset

    return get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=16, limit=8)


def test_lora_finetune_preset_trains_with_get_trainer(tiny_data: tuple[dict, object], tmp_path: Path) -> None:
    from fxforge.models.bert import tiny_bert

    ds, tok = tiny_data
    mg = ForgeGraph(tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    finetune = {"tokenized_dataset": ds, "tokenizer": tok,
                "trainer": {"output_dir": str(tmp_path), "max_steps": 2, "learning_rate": 1e-2,
                            "per_device_train_batch_size": 4}}
    pipe = Pipeline.preset("lora-finetune", args={"finetune": finetune})
    out, report = pipe(mg)
    assert [s.name for s in report.steps] == ["insert_lora_adapter_transform_pass", "finetune",
                                              "fuse_lora_weights_transform_pass"]
    assert report[1].contract.kind == "bounded" and report[1].contract.max_abs > 0  # training changed outputs
    test = ds["test"]  # the reported accuracy is the trained graph's own on the test split
    batch = tok.pad({"input_ids": test["input_ids"], "attention_mask": test["attention_mask"]}, return_tensors="pt")
    labels = torch.tensor(test["labels"])
    with torch.no_grad():
        logits = out.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).logits
    assert report[1].info.eval["eval_accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    assert out.history[0].args["steps"][1]["replayable"] is False
    with pytest.raises(PipelineError, match="finetune"):
        Pipeline.from_history(out)
    with pytest.raises(PipelineError, match=r"qat=True fine-tunes the quantized model"):
        CompressionPipeline(qat=True).build({"insert_lora_adapter_transform_pass": {}, "finetune": finetune})
