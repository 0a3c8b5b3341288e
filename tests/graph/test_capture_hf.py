"""Capture reach: tiny random HF causal LMs, T5, ViT and ResNet equal eager at two shapes, take metadata, a LoRA
insert and an export/reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hf_tiny import CAUSAL_LMS, INPUT_NAMES, hf_inputs, tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.passes.transform.lora import LoraLinear

FAMILIES = (*CAUSAL_LMS, "t5", "vit", "resnet")
# (batch, length) for text, (batch, side) for images; ViT's position embeddings fix its side.
SHAPES = {"vit": [(3, 32), (1, 32)], "resnet": [(3, 40), (1, 24)]}
TEXT_SHAPES = [(3, 11), (1, 7)]


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[nn.Module, ForgeGraph]]:
    """family -> (eager model, its graph), captured once per family on first use."""
    return {}


def _get(captured: dict[str, tuple[nn.Module, ForgeGraph]], family: str) -> tuple[nn.Module, ForgeGraph]:
    if family not in captured:
        model = tiny_hf(family)
        captured[family] = (model, ForgeGraph(model, hf_input_names=INPUT_NAMES[family]))
    return captured[family]


def _cases(family: str) -> list[dict[str, torch.Tensor]]:
    shapes = SHAPES.get(family, TEXT_SHAPES)
    pads = (False,) if family in ("vit", "resnet") else (False, True)
    return [hf_inputs(family, b, s, left_pad=p) for b, s in shapes for p in pads]


def _max_diff(got: object, want: object) -> float:
    return max(float((got.logits - want.logits).abs().max()), float((got.loss - want.loss).abs()))  # type: ignore


@pytest.mark.parametrize("family", FAMILIES)
def test_equals_eager_at_two_shapes(captured: dict, family: str) -> None:
    model, mg = _get(captured, family)
    assert mg.frontend == "export"
    mg.eval()
    for inputs in _cases(family):
        with torch.no_grad():
            got, want = mg(**inputs), model(**inputs)
        assert type(got) is type(want)
        assert _max_diff(got, want) <= 1e-5, (family, {k: tuple(v.shape) for k, v in inputs.items()})
    if family in CAUSAL_LMS or family == "t5":
        assert any("use_cache was turned off" in n for n in mg.capture_notes)
        assert model.config.use_cache is True  # restored after capture
        assert getattr(got, "past_key_values", None) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_metadata_lora_and_checkpoint(captured: dict, family: str, tmp_path: Path) -> None:
    model, base = _get(captured, family)
    mg = base.copy()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    ops = {mg.meta(n).common.op for n in mg.nodes}
    assert "linear" in ops or "conv2d" in ops
    mg.eval()
    inputs = _cases(family)[0]
    with torch.no_grad():
        ref = mg(**inputs)
    if family == "resnet":  # the only linear is the classifier
        mg, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2})
    else:
        mg, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "targets": {"regex": r".*(0|1).*"}})
    assert len(info.adapted) >= 1
    with torch.no_grad():
        for module in mg.model.modules():  # non-zero adapters, so the checkpoint must carry them
            if isinstance(module, LoraLinear):
                module.lora_B.normal_(std=0.05)
        adapted = mg(**inputs)
    assert _max_diff(adapted, ref) > 1e-4
    mg.export(tmp_path / "ckpt")
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt").eval()
    for case in _cases(family):
        with torch.no_grad():
            assert _max_diff(back(**case), mg(**case)) <= 1e-5


def test_position_ids_and_left_padding_on_llama() -> None:
    model = tiny_hf("llama")
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "position_ids"]).eval()
    for batch, seq in TEXT_SHAPES:
        inputs = hf_inputs("llama", batch, seq, left_pad=True)
        del inputs["labels"]
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            got, want = mg(**inputs).logits, model(**inputs).logits
        assert (got - want).abs().max() <= 1e-5
        assert not torch.equal(want, model(input_ids=inputs["input_ids"]).logits)  # the inputs matter

