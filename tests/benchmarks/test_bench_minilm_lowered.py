"""bench_minilm_lowered end to end on the pretrained MiniLM with tiny settings (16 reviews of 16 tokens, one
round): what it prints and writes is what it measured, and its checks follow from those numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fxforge import ForgeGraph


def test_bench_prints_measured_sizes_latencies_and_accuracies(
        tmp_path: Path, minilm_classifier: torch.nn.Module, capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.benchmarks.bench_minilm_lowered import TARGETS, main

    model = ForgeGraph(minilm_classifier, hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    model.export(tmp_path / "fp32")
    code = main(["--model", str(tmp_path / "fp32"), "--eval", "16", "--length", "16", "--rounds", "1",
                 "--ffn", "0.85", "--method", "l1", "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    assert text.startswith("CPU: ") and "threads" in text.splitlines()[0]
    assert re.search(r"^ceiling: the point does 0\.\d\dx fp32's Linear MACs at 8x16", text, re.M)
    assert res["disk_bytes"]["fp32"] == (tmp_path / "fp32" / "weights.safetensors").stat().st_size
    ratio = res["disk_bytes"]["lowered"] / res["disk_bytes"]["fp32"]
    assert re.search(rf"^on disk +[0-9.]+ +[0-9.]+ +{ratio:.3f}", text, re.M)
    resident = res["resident_bytes"]
    assert ratio <= TARGETS["size"] and resident["lowered"] <= TARGETS["size"] * resident["fp32"]
    # onnxruntime is in the lock: its row runs (fxforge's fp32 ONNX export, ORT's dynamic int8 on it)
    rows = {"fp32", "lowered", "torch.ao dynamic int8", "onnxruntime dynamic int8"}
    assert set(res["median_ms"]) == rows and set(res["accuracy"]) == rows | {"simulated"}
    assert all(0 <= a <= 1 for a in res["accuracy"].values()) and res["eval_reviews"] == 16
    assert "onnxruntime is not installed" not in text
    assert code == (0 if all(res["checks"].values()) else 1)
    assert len(re.findall(r"^(met   |MISSED) ", text, re.M)) == len(res["checks"]) == 4
