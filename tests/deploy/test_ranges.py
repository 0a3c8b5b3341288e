"""Dynamic axes' ranges: deploy.json records each dynamic axis's allowed sizes (inputs from the graph's shape
guard, outputs following an input's axis), and nobody runs the artifact outside them silently: ONNX Runtime hits
the graph's range guard (named for the input, axis and range) before any other node, and the check runner refuses
a case outside the recorded ranges. Measured before the guard: the tiny BERT export at sequence 65 (guard 2..64)
failed inside ORT with ``invalid expand shape`` at ``node_expand_1`` (the token-type buffer sliced to 64), naming
neither the input nor the bound; sequence 1 ran. (The zoo GPT's torch.export-proven bound is asserted in
test_export_float's GPT export.)"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.deploy import DeployError, export_aoti, export_onnx, read_manifest
from fxforge.deploy.check import CheckCase, check_artifact
from fxforge.deploy.manifest import AxisRange
from fxforge.deploy.onnx_float import write_onnx
from fxforge.deploy.signature import export_program, inference_signature


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()


@pytest.fixture(scope="module")
def bert_onnx(bert: ForgeGraph, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("ranges") / "bert"  # the subprocess check runs in test_export_float's export
    return out, export_onnx(bert, out, source="tiny-bert", check=False)


def _session(path: Path) -> Any:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(str(path / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in bert_inputs(batch=batch, seq=seq, labels=False).items()}


def test_manifest_records_input_and_output_ranges(bert_onnx: tuple[Path, Any]) -> None:
    out, manifest = bert_onnx
    assert manifest.version == 2 and read_manifest(out) == manifest
    assert manifest.axis_ranges == {
        "input_ids": {0: AxisRange(1, None), 1: AxisRange(2, 64)},
        "attention_mask": {0: AxisRange(1, None), 1: AxisRange(2, 64)},
        "logits": {0: AxisRange(1, None, "input_ids[0]")},  # logits' batch follows the input's
    }
    assert manifest.dynamic_axes["logits"] == {0: "batch"}
    doc = json.loads((out / "deploy.json").read_text())
    assert doc["axis_ranges"]["input_ids"]["1"] == {"min": 2, "max": 64}


def test_onnx_runtime_refuses_a_sequence_past_the_guard_naming_it(bert: ForgeGraph,
                                                                  bert_onnx: tuple[Path, Any]) -> None:
    session = _session(bert_onnx[0])
    for batch, seq in ((1, 64), (3, 2)):  # both ends of the range still run, equal to the graph
        (logits,) = session.run(None, _feeds(batch, seq))
        with torch.no_grad():
            want = bert(**bert_inputs(batch=batch, seq=seq, labels=False)).logits
        assert np.allclose(logits, want.numpy(), rtol=1e-4, atol=1e-6)
    for seq in (65, 300, 1):
        with pytest.raises(Exception, match=r"(input_ids|attention_mask) axis 1 \(seq\) must be 2\.\.64"):
            session.run(None, _feeds(2, seq))


def _optimized_ops(path: Path, tmp: Path) -> Counter[str]:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp / f"{path.stem}-opt.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


@pytest.mark.slow_deploy  # a second export and two ORT optimisations: make test-deploy
def test_range_guard_leaves_ort_fusions_alone(bert: ForgeGraph, bert_onnx: tuple[Path, Any], tmp_path: Path) -> None:
    """ORT's optimized graph of the guarded file holds every op of the unguarded file's, plus the guard's."""
    plain = write_onnx(export_program(inference_signature(bert), True, True), tmp_path / "plain.onnx")
    guarded, unguarded = _optimized_ops(bert_onnx[0] / "model.onnx", tmp_path), _optimized_ops(plain, tmp_path)
    assert unguarded - guarded == Counter()
    assert set(guarded - unguarded) <= {"Shape", "Sub", "Min", "Gather", "Cast", "Where"}, guarded - unguarded
    assert (guarded - unguarded)["Where"] == 2  # input_ids and attention_mask


def test_check_runner_refuses_a_case_outside_the_ranges(bert: ForgeGraph, bert_onnx: tuple[Path, Any]) -> None:
    out, manifest = bert_onnx
    x = bert_inputs(batch=2, seq=70, labels=False)
    case = CheckCase(inputs=x, expected={"logits": torch.zeros(2, 2)})
    with pytest.raises(DeployError, match=r"input 'input_ids' axis 1 \(seq\) has size 70, outside the artifact's "
                                          r"range 2\.\.64"):
        check_artifact(out, "onnx", [case], 1e-4, "relative", ranges=manifest.axis_ranges,
                       labels=manifest.dynamic_axes)


def test_inspect_lines_and_report_row_show_the_ranges(bert_onnx: tuple[Path, Any]) -> None:
    from fxforge.cli.deploy_view import manifest_lines, report_row

    out, manifest = bert_onnx
    text = " ".join(" ".join(manifest_lines(manifest, out, 100)).split())
    assert "inputs: input_ids (dim 0: batch >= 1, dim 1: seq in 2..64), attention_mask (dim 0: batch >= 1, " \
           "dim 1: seq in 2..64)" in text
    assert "outputs: logits (dim 0: batch = input_ids[0])" in text
    assert report_row(manifest, out).dynamic_axes == (
        "input_ids[0]=batch >= 1, input_ids[1]=seq in 2..64, attention_mask[0]=batch >= 1, "
        "attention_mask[1]=seq in 2..64, logits[0]=batch (= input_ids[0])")


_AOTI_RUN = """
import os, sys, torch
os.environ.update({env})
package = torch._inductor.aoti_load_package(sys.argv[1])
for batch, seq in ((1, 16), (2, 65)):
    ids = torch.randint(0, 100, (batch, seq))
    try:
        with torch.no_grad():
            (logits,) = package(ids, torch.ones_like(ids))
        print(batch, seq, "ran", list(logits.shape))
    except Exception as exc:
        print(batch, seq, "refused", " ".join(str(exc).split()))
"""


@pytest.mark.slow_deploy  # an AOTInductor compile: make test-deploy
def test_aoti_package_refuses_past_the_bound_with_its_input_checks(bert: ForgeGraph, tmp_path: Path) -> None:
    """Measured: the tiny BERT package runs sequence 65 (past its 64 positions) silently unless loaded with
    AOTI_RUNTIME_CHECK_INPUTS=1, as the check runner loads it; then it refuses 65 and still runs batch 1."""
    import subprocess
    import sys

    manifest = export_aoti(bert, tmp_path / "aoti")
    assert manifest.passed and manifest.axis_ranges["input_ids"][1] == AxisRange(2, 64)
    runs = {}
    for env in ("{}", "{'AOTI_RUNTIME_CHECK_INPUTS': '1'}"):
        proc = subprocess.run([sys.executable, "-c", _AOTI_RUN.format(env=env), str(tmp_path / "aoti" / "model.pt2")],
                              capture_output=True, text=True, timeout=600, check=True)
        runs[env] = proc.stdout.splitlines()
    assert runs["{}"] == ["1 16 ran [1, 2]", "2 65 ran [2, 2]"]  # silently past the bound
    checked = runs["{'AOTI_RUNTIME_CHECK_INPUTS': '1'}"]
    assert checked[0] == "1 16 ran [1, 2]" and checked[1].startswith("2 65 refused"), checked
    assert "too large at 1, expected to be <= 64, but got: 65" in checked[1]
