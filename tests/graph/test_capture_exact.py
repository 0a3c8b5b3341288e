"""Captured HF decoders equal eager bit for bit (torch.equal), in eval and train mode and after a checkpoint round trip.

The three models the reach sweep (issue 27) found differing by one or two float32 ulps: GPT-2 (HF Conv1D lifted to
nn.Linear), GPT-Neo (fp32-upcasting eager attention, local windows) and BioGPT, each at two shapes with the last row
of every batch padded. The eager reference is called with ``use_cache=False``, the computation the graph holds
(capture turns HF's cache off): with the cache on, eager's keys pass through ``DynamicCache.update``'s
``torch.cat`` and reach ``matmul(q, k.T)`` contiguous instead of as a permuted view, which takes another BLAS path
(GPT-Neo's eval logits then differ by 1.2e-07 at (3, 11), and so does raw torch.export's module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from reach.tiny_archs import build, capture_inputs, check_inputs

from fxforge import ForgeGraph

MODELS = ("gpt2", "gpt_neo", "biogpt")


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[nn.Module, ForgeGraph]]:
    """name -> (eager model, its captured graph), captured once per module."""
    return {}


def _get(captured: dict[str, tuple[nn.Module, ForgeGraph]], name: str) -> tuple[nn.Module, ForgeGraph]:
    if name not in captured:
        model = build(name)
        captured[name] = (model, ForgeGraph(model, example_inputs=capture_inputs(name)))
    return captured[name]


def _eager(model: nn.Module, x: dict[str, torch.Tensor]) -> Any:
    return model(**x, use_cache=False)  # what the graph computes: capture turns the KV cache off


def _assert_equal(got: Any, want: Any, what: str) -> None:
    """Every tensor field of ``want`` is in ``got`` with equal shape, dtype and bits."""
    for key, value in want.items():
        if not isinstance(value, torch.Tensor):
            continue
        other = got[key]
        assert other.shape == value.shape and other.dtype == value.dtype, f"{what}: {key}"
        diff = (other.double() - value.double()).abs().max().item()
        assert torch.equal(other, value), f"{what}: {key} differs by {diff:.3g}"


def _shape(x: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(x["input_ids"].shape)


@pytest.mark.parametrize("name", MODELS)
def test_eval_graph_equals_eager_exactly(captured: dict[str, tuple[nn.Module, ForgeGraph]], name: str) -> None:
    model, graph = _get(captured, name)
    graph.eval()
    for x in check_inputs(name):
        assert x["attention_mask"][-1].sum() < x["attention_mask"].shape[1]  # the last row is padded
        with torch.no_grad():
            _assert_equal(graph(**x), _eager(model, x), f"{name} eval at {_shape(x)}")


@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_reload_equals_graph_exactly(captured: dict[str, tuple[nn.Module, ForgeGraph]], name: str,
                                                 tmp_path: Path) -> None:
    model, graph = _get(captured, name)
    graph.eval().export(tmp_path / "ckpt")
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt").eval()
    for x in check_inputs(name):
        with torch.no_grad():
            want = graph(**x)
            _assert_equal(back(**x), want, f"{name} reloaded vs captured at {_shape(x)}")
            _assert_equal(back(**x), _eager(model, x), f"{name} reloaded vs eager at {_shape(x)}")


@pytest.mark.parametrize("name", MODELS)
def test_train_graph_equals_eager_with_same_seed(captured: dict[str, tuple[nn.Module, ForgeGraph]],
                                                 name: str) -> None:
    model, graph = _get(captured, name)
    train_graph = graph.copy().train()
    model.train()
    try:
        x = capture_inputs(name)
        live = not torch.equal(*(_eager(model, x).logits for _ in range(2)))  # random dropout (BioGPT: functional)
        assert live == (name != "gpt_neo")  # GPT-Neo's config sets every dropout to 0.0
        for x in (capture_inputs(name), *check_inputs(name)):
            torch.manual_seed(0)
            got = train_graph(**x)
            torch.manual_seed(0)
            want = _eager(model, x)
            _assert_equal(got, want, f"{name} train at {_shape(x)}")
            if live:  # dropout is live in the graph: another seed gives other logits
                torch.manual_seed(1)
                assert not torch.equal(train_graph(**x).logits, got.logits)
    finally:
        model.eval()


def test_checkpoint_keeps_a_transposed_weight_layout(captured: dict[str, tuple[nn.Module, ForgeGraph]],
                                                     tmp_path: Path) -> None:
    """GPT-2's Conv1D becomes an nn.Linear whose weight is the transposed view of HF's [in, out] weight: F.linear
    on that layout runs eager's addmm(bias, x, W). Reloaded contiguous, the same values take the other transposed
    BLAS path and differ in the last bit, so the checkpoint keeps every tensor's memory layout."""
    _, graph = _get(captured, "gpt2")
    graph.export(tmp_path / "ckpt")
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    before, after = graph.model.state_dict(), back.model.state_dict()
    transposed = [k for k, t in before.items() if not t.is_contiguous()]
    assert "transformer.h.0.attn.c_attn.weight" in transposed
    for k in before:
        assert after[k].stride() == before[k].stride() and torch.equal(after[k], before[k]), k
