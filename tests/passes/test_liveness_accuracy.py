"""liveness_analysis_pass's estimates against the allocator's measured peaks, within 10%: the inference peak
(one no-grad forward) and the training step's peak (forward + backward of the summed outputs, weight grads
allocated beforehand; passes/analysis/step_memory.py defines both sides), before and after
activation_checkpoint_transform_pass (its regions keep their inputs and recompute in backward). Tiny BERT and
tiny GPTs at two shapes each stay fast; MiniLM at 8x128 and the GPT at T=1024 are slow."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes.analysis.step_memory import allocator_peak, output_loss
from fxforge.passes.base import PassError
from fxforge.passes.memory import activation_checkpoint_transform_pass


def _assert_within_10pct(mg: ForgeGraph, data: Any = None) -> Any:
    passes.init_metadata_analysis_pass(mg)
    _, info = passes.liveness_analysis_pass(mg, {"measure": True} if data is None else {"measure": True, "data": data})
    for est, real in ((info.peak_inference_bytes, info.measured_inference_bytes),
                      (info.peak_step_bytes, info.measured_step_bytes)):
        assert real and abs(est - real) <= 0.10 * real, (est, real)
    return info


def _before_and_after(mg: ForgeGraph, fraction: float, data: Any = None) -> tuple[Any, Any]:
    """Estimates within 10% on the graph and on its checkpointed rewrite (which really needs less memory)."""
    before = _assert_within_10pct(mg, data)
    assert before.measured_step_bytes > before.measured_training_bytes  # backward adds gradients to the saved ones
    for f in (fraction, fraction + 0.1, fraction + 0.2):  # the first budget the planner reaches
        args: dict[str, Any] = {"fraction": f} if data is None else {"fraction": f, "data": data}
        try:
            ckpt, plan = activation_checkpoint_transform_pass(mg, args)
            break
        except PassError:
            continue
    else:
        pytest.fail(f"no plan up to fraction {fraction + 0.2}")
    assert plan.segments > 0
    after = _assert_within_10pct(ckpt, data)
    assert after.measured_step_bytes < before.measured_step_bytes  # a different memory profile, really lower
    return before, after


@pytest.mark.parametrize(("batch", "seq"), [(3, 11), (8, 64)])
def test_step_estimate_on_tiny_bert(batch: int, seq: int) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])
    before, _ = _before_and_after(mg, 0.7, bert_inputs(batch=batch, seq=seq, labels=False))
    assert before.peak_step_bytes > before.peak_training_bytes  # the step peaks in backward, not at the forward's end


@pytest.mark.parametrize(("mixer", "batch", "seq"), [("attn", 2, 32), ("attn", 4, 128)])
def test_step_estimate_on_tiny_gpt(mixer: str, batch: int, seq: int) -> None:
    mg = ForgeGraph(make_gpt(mixer, sequence_length=seq, n_embd=64), (torch.randint(0, 64, (batch, seq)),))
    _before_and_after(mg, 0.6)


def test_measured_step_counts_no_parameter_grads_and_restores_them() -> None:
    """Weight grads are allocated before the measured step, so a step's figure is activations and transients
    only; the grads a user had are given back untouched."""
    mg = ForgeGraph(make_gpt("attn"), (torch.randint(0, 64, (2, 32)),))
    passes.init_metadata_analysis_pass(mg)
    marker = torch.full_like(mg.model.lm_head.weight, 7.0)
    mg.model.lm_head.weight.grad = marker
    _, info = passes.liveness_analysis_pass(mg, {"measure": True})
    assert mg.model.lm_head.weight.grad is marker and bool((marker == 7.0).all())
    assert all(p.grad is None for n, p in mg.model.named_parameters() if n != "lm_head.weight")
    # the same step with grads freshly allocated keeps them: the allocator ends that many bytes higher
    _, held, _ = allocator_peak(lambda: output_loss(mg.model(torch.randint(0, 64, (2, 32)))).backward())
    grads = sum(p.numel() * 4 for n, p in mg.model.named_parameters() if n != "lm_head.weight")
    assert held == grads and info.measured_step_bytes < held + info.measured_training_bytes


@pytest.mark.slow
def test_step_estimate_on_minilm_8x128(minilm_classifier: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    data = {"input_ids": torch.randint(1000, 30000, (8, 128), generator=gen),
            "attention_mask": torch.ones(8, 128, dtype=torch.long)}
    _before_and_after(ForgeGraph(minilm_classifier, hf_input_names=["input_ids", "attention_mask"]), 0.5, data)


@pytest.mark.slow
def test_step_estimate_on_gpt_t1024() -> None:
    gpt = make_gpt("attn", vocab_size=256, sequence_length=1024, n_layer=4, n_head=4, n_embd=128)
    _before_and_after(ForgeGraph(gpt, (torch.randint(0, 256, (4, 1024)),)), 0.5)
