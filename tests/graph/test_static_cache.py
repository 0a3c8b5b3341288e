"""Decoders captured with an explicit static KV cache (graph/static_cache): tiny Llama (with and without grouped
KV heads) and GPT-2 take (input_ids, cache_position, k_0, v_0, ...) and return (logits, k_0', v_0', ...) as a
pure function, equal eager at two cache fill levels, pass the metadata and quantize passes, and keep their cache
spec through a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hf_tiny import tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.graph.static_cache import (
    NOTE_PREFIX,
    StaticCacheLM,
    StaticCacheSpec,
    capture_static_cache,
    static_cache_spec,
)

MAX_LEN = 24
WEIGHT_INT8 = {"by": "type", "linear": {"config": {"name": "scaled_integer", "weight_width": 8,
                                                   "weight_granularity": "per_channel"}}}
# name -> (family, config overrides); "llama" has 2 KV heads for 4 query heads (grouped), "llama-mha" 4 for 4
MODELS = {"llama": ("llama", {}), "llama-mha": ("llama", {"num_key_value_heads": 4}), "gpt2": ("gpt2", {})}


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[nn.Module, ForgeGraph]]:
    return {}


def _get(captured: dict[str, tuple[nn.Module, ForgeGraph]], name: str) -> tuple[nn.Module, ForgeGraph]:
    if name not in captured:
        family, overrides = MODELS[name]
        lm = tiny_hf(family, **overrides)
        captured[name] = (lm, capture_static_cache(lm, MAX_LEN))
    return captured[name]


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 100, (1, length), generator=torch.Generator().manual_seed(seed))


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], atol: float = 0.0) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and (torch.equal(x, y) if atol == 0 else
                                                            torch.allclose(x, y, rtol=0, atol=atol))
                                    for x, y in zip(a, b))


class _StarArgs(nn.Module):
    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) * rest[0] + rest[1]


def test_a_forward_with_star_args_captures_with_dynamic_shapes() -> None:
    """torch.export binds ``*rest`` as one argument, so its shape specs go in as one tuple (capture built a flat
    tuple and export refused: "inputs has 2 elements, but dynamic_shapes has 3")."""
    mg = ForgeGraph(_StarArgs(), example_inputs=(torch.randn(3, 5), torch.randn(3, 1), torch.randn(3, 1)),
                    frontend="export")
    for batch in (3, 7):
        args = (torch.randn(batch, 5), torch.randn(batch, 1), torch.randn(batch, 1))
        assert torch.equal(mg(*args), _StarArgs()(*args))


@pytest.mark.parametrize("name", list(MODELS))
def test_cache_is_explicit_inputs_and_outputs_updated_functionally(captured: Any, name: str) -> None:
    lm, mg = _get(captured, name)
    spec = static_cache_spec(mg)
    layers = lm.config.num_hidden_layers
    heads = 2 if name == "llama" else 4
    assert spec.shapes() == [(1, heads, MAX_LEN, 8)] * (2 * layers)
    placeholders = [n for n in mg.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2 + 2 * layers
    targets = [str(n.target) for n in mg.nodes if n.op == "call_function"]
    assert sum("index_copy.default" in t for t in targets) == 2 * layers
    assert not any(t.endswith("_.default") or "copy_" in t for t in targets), "in-place writes in a pure step"
    cache = spec.empty()
    logits, *new = mg(_prompt(5), torch.arange(5), *cache)
    assert logits.shape == (1, 5, lm.config.vocab_size) and len(new) == 2 * layers
    assert all(torch.count_nonzero(c) == 0 for c in cache), "the step wrote into its input cache"
    assert all(torch.count_nonzero(c[:, :, 5:]) == 0 and torch.count_nonzero(c[:, :, :5]) > 0 for c in new)


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_decode_steps_equal_eager_at_two_fill_levels(captured: Any, name: str) -> None:
    """Prefill is bit-exact. Decode (T = 1) is bit-exact too, except with grouped KV heads: eager HF then folds
    the query heads onto the KV heads (pack_gqa, skipped under tracing, so the graph repeats K/V instead), which
    rounds differently by ~1e-8; documented tolerance 1e-6."""
    lm, mg = _get(captured, name)
    eager = StaticCacheLM(lm).eval()
    cache = tuple(static_cache_spec(mg).empty())
    with torch.no_grad():
        want = eager(_prompt(9), torch.arange(9), *cache)
        got = mg(_prompt(9), torch.arange(9), *cache)
        assert _same(want, got)
        atol = 1e-6 if name == "llama" else 0.0
        for fill in (9, 17):  # two cache fill levels, each stepped from the graph's own cache
            token = torch.tensor([[fill % 97 + 1]])
            want = eager(token, torch.tensor([fill]), *got[1:])
            got = mg(token, torch.tensor([fill]), *got[1:])
            assert _same(want, got, atol), f"{name}: decode at fill {fill} differs from eager"
            if atol:
                assert not torch.equal(got[1][:, :, fill], torch.zeros_like(got[1][:, :, fill]))


def test_metadata_and_quantize_passes_run_on_the_cache_graph(captured: Any) -> None:
    """Weight-only int8 (what the weight-only lowering maps to a kernel) on every linear, lm_head included."""
    _, mg = _get(captured, "llama")
    q = mg.copy()
    q, _ = passes.init_metadata_analysis_pass(q)
    q, _ = passes.add_common_metadata_analysis_pass(q)
    q, _ = passes.quantize_transform_pass(q, WEIGHT_INT8)
    quantized = [n for n, m in q.modules().items() if type(m).__name__ == "QuantizedLinear"]
    assert len(quantized) >= 14, quantized  # 7 linears per layer (q, k, v, o, gate, up, down) + lm_head
    cache = tuple(static_cache_spec(q).empty())
    with torch.no_grad():
        ref = mg(_prompt(6), torch.arange(6), *cache)
        out = q(_prompt(6), torch.arange(6), *cache)
        step_ref = mg(torch.tensor([[5]]), torch.tensor([6]), *ref[1:])
        step = q(torch.tensor([[5]]), torch.tensor([6]), *out[1:])
    assert static_cache_spec(q) == static_cache_spec(mg)
    for a, b in ((ref[0], out[0]), (step_ref[0], step[0])):
        assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05), (a - b).abs().max()


def test_cache_spec_survives_export_and_reload(captured: Any, tmp_path: Path) -> None:
    _, mg = _get(captured, "gpt2")
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt"))
    assert static_cache_spec(back) == static_cache_spec(mg)
    cache = tuple(static_cache_spec(back).empty())
    with torch.no_grad():
        a = mg(_prompt(4), torch.arange(4), *cache)
        b = back(_prompt(4), torch.arange(4), *cache)
        assert _same(a, b)
        assert _same(mg(torch.tensor([[3]]), torch.tensor([4]), *a[1:]),
                     back(torch.tensor([[3]]), torch.tensor([4]), *b[1:]))


def test_a_step_past_the_cache_or_of_another_batch_is_refused(captured: Any) -> None:
    _, mg = _get(captured, "gpt2")
    cache = static_cache_spec(mg).empty()
    with pytest.raises(ValueError, match="cache_0"):
        mg(_prompt(2), torch.arange(2), *[torch.zeros(2, *c.shape[1:]) for c in cache])
    from fxforge.graph.static_cache import cache_inputs

    with pytest.raises(ValueError, match="larger max_cache_len"):
        cache_inputs(static_cache_spec(mg), _prompt(3), MAX_LEN - 2, cache)


@pytest.mark.parametrize("field,value", [("batch", 0), ("max_cache_len", "8"), ("layers", []), ("dtype", "object"),
                                         ("eos_token_ids", [-1]), ("layers", [[1, 2]]), ("extra", 1)])
def test_a_hostile_cache_note_is_refused(field: str, value: Any) -> None:
    good = StaticCacheSpec(batch=1, max_cache_len=8, layers=((2, 4, 4),), dtype="float32", eos_token_ids=(0,))
    assert StaticCacheSpec.from_json(good.to_json()) == good
    doc = {**json.loads(good.to_json()), field: value}
    with pytest.raises(ValueError, match="static cache note"):
        StaticCacheSpec.from_json(json.dumps(doc))


def test_a_graph_without_a_cache_note_says_how_to_get_one(bert_graph: Any) -> None:
    with pytest.raises(ValueError, match="capture_static_cache"):
        static_cache_spec(bert_graph)
    assert NOTE_PREFIX.startswith("static_kv_cache")


def test_sliding_window_layers_are_refused() -> None:
    lm = tiny_hf("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="full-attention layers only"):
        capture_static_cache(lm, MAX_LEN)


def test_inplace_cache_updates_compute_the_same_steps_writing_into_the_given_cache(captured: Any) -> None:
    from fxforge.graph.static_cache import inplace_cache_updates

    _, mg = _get(captured, "llama")
    fast = inplace_cache_updates(mg)
    assert sum(1 for n in fast.nodes if n.target is torch.ops.aten.index_copy_.default) == 4
    assert not any(n.target is torch.ops.aten.index_copy_.default for n in mg.nodes), "the pure graph changed"
    pure = tuple(static_cache_spec(mg).empty())
    owned = tuple(static_cache_spec(mg).empty())
    with torch.no_grad():
        for start, ids in ((0, _prompt(6)), (6, torch.tensor([[4]])), (7, torch.tensor([[9]]))):
            positions = torch.arange(start, start + ids.shape[1])
            want = mg(ids, positions, *pure)
            got = fast(ids, positions, *owned)
            pure = tuple(want[1:])
            assert _same(want, got) and all(g is o for g, o in zip(got[1:], owned))
