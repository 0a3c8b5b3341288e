"""Greedy generation from the static-cache graph (pipelines/generate): exactly HF ``generate(do_sample=False)``'s
tokens for tiny Llama and GPT-2 over several prompt lengths and long decodes, the same after a checkpoint reload,
and on a weight-quantized graph the same tokens as a step-by-step run of that graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hf_tiny import tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.graph.static_cache import capture_static_cache, static_cache_spec
from fxforge.pipelines import generate

MAX_LEN = 48
# (prompt length, new tokens): a one-token prompt, and runs crossing into many decode steps up to a full cache
CASES = [(1, 6), (3, 30), (7, 42), (12, 9)]


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[nn.Module, ForgeGraph]]:
    out = {}
    for family in ("llama", "gpt2"):
        lm = tiny_hf(family)
        out[family] = (lm, capture_static_cache(lm, MAX_LEN))
    return out


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 100, (1, length), generator=torch.Generator().manual_seed(seed))


def _hf(lm: nn.Module, prompt: torch.Tensor, new: int, **kw: Any) -> torch.Tensor:
    return lm.generate(prompt, max_new_tokens=new, do_sample=False, **kw)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_tokens_equal_hf_generate(models: Any, family: str) -> None:
    lm, mg = models[family]
    full = 0
    for seed, (length, new) in enumerate(CASES):
        prompt = _prompt(length, seed)
        ours = generate(mg, prompt, new, eos_token_ids=[])
        want = _hf(lm, prompt, new, eos_token_id=None)
        assert torch.equal(ours, want), f"{family} prompt {length} + {new}: {ours.tolist()} != {want.tolist()}"
        full += ours.shape[1] == length + new
    assert full == len(CASES)
    # with the model's own end-of-sequence token (recorded at capture), as HF stops
    prompt = _prompt(4, 99)
    assert torch.equal(generate(mg, prompt.tolist()[0], 30), _hf(lm, prompt, 30))


def test_generation_stops_at_eos_as_hf_does(models: Any) -> None:
    lm, mg = models["llama"]
    prompt = _prompt(5, 3)
    free = generate(mg, prompt, 12, eos_token_ids=[])
    eos = int(free[0, 8])  # the 4th new token: make it the end-of-sequence token
    ours = generate(mg, prompt, 12, eos_token_ids=[eos])
    want = _hf(lm, prompt, 12, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(ours, want) and ours.shape[1] <= 9


def test_tokens_survive_export_and_reload(models: Any, tmp_path: Path) -> None:
    for family in ("llama", "gpt2"):
        lm, mg = models[family]
        back = ForgeGraph.from_checkpoint(mg.export(tmp_path / family))
        for seed, (length, new) in enumerate(CASES[1:3]):
            prompt = _prompt(length, seed + 10)
            assert torch.equal(generate(back, prompt, new, eos_token_ids=[]),
                               _hf(lm, prompt, new, eos_token_id=None))


def test_quantized_graph_generates_what_its_steps_compute(models: Any) -> None:
    """After int8 weight-only quantization the loop still runs the graph: its tokens are the argmax of the
    quantized graph's own steps (recomputed here without cache reuse: a fresh prefill of the whole sequence)."""
    _, mg = models["gpt2"]
    q = mg.copy()
    q, _ = passes.init_metadata_analysis_pass(q)
    q, _ = passes.add_common_metadata_analysis_pass(q)
    q, _ = passes.quantize_transform_pass(q, {"by": "type", "linear": {"config": {
        "name": "scaled_integer", "weight_width": 8, "weight_granularity": "per_channel"}}})
    prompt = _prompt(6, 5)
    ours = generate(q, prompt, 10, eos_token_ids=[])
    spec = static_cache_spec(q)
    with torch.no_grad():
        for k in range(6, ours.shape[1]):
            logits = q(ours[:, :k], torch.arange(k), *spec.empty())[0]
            assert int(logits[0, -1].argmax()) == int(ours[0, k])


def test_bad_requests_are_refused_with_the_remedy(models: Any) -> None:
    _, mg = models["gpt2"]
    with pytest.raises(ValueError, match="larger max_cache_len"):
        generate(mg, _prompt(40, 0), 10)
    with pytest.raises(ValueError, match="batch=2"):
        generate(mg, torch.ones(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="non-empty"):
        generate(mg, [], 4)
    assert torch.equal(generate(mg, [5, 6], 0), torch.tensor([[5, 6]]))


def test_a_batch_of_equal_length_prompts_equals_hf() -> None:
    lm = tiny_hf("llama", seed=3)
    mg = capture_static_cache(lm, 24, batch=2)
    prompt = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(generate(mg, prompt, 16, eos_token_ids=[]), _hf(lm, prompt, 16, eos_token_id=None))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lowered_graphs_generate_the_tokens_of_their_simulated_twins(fmt: str, tmp_path: Path) -> None:
    """int8 per-channel / MXINT4 (block 32) weight-only quantization, then lower_weight_only_transform_pass: the
    linears run on real low-bit kernels and the generated tokens equal the simulated graph's, also reloaded."""
    lm = tiny_hf("llama", hidden_size=64, intermediate_size=128)
    mg = capture_static_cache(lm, 40)
    weight = {"int8": {"name": "scaled_integer", "weight_width": 8, "weight_granularity": "per_channel"},
              "int4": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}[fmt]
    sim, _ = passes.init_metadata_analysis_pass(mg)
    sim, _ = passes.add_common_metadata_analysis_pass(sim)
    sim, _ = passes.quantize_transform_pass(sim, {"by": "type", "linear": {"config": weight}})
    low, info = passes.lower_weight_only_transform_pass(sim.copy())
    kinds = set(info.lowered.values())
    # MXINT4: the LM head's rows (the vocabulary) are not a multiple of 16, so it takes the bf16 group path
    expected = {"int8": {"int8"}, "int4": {"int4 g32", "group g32"}}[fmt]
    assert len(info.lowered) >= 14 and kinds == expected and info.skipped == {}, info
    back = ForgeGraph.from_checkpoint(low.export(tmp_path / "lowered"))
    for seed, (length, new) in enumerate([(1, 12), (5, 30)]):
        prompt = _prompt(length, seed + 20)
        want = generate(sim, prompt, new, eos_token_ids=[])
        assert torch.equal(generate(low, prompt, new, eos_token_ids=[]), want)
        assert torch.equal(generate(back, prompt, new, eos_token_ids=[]), want)


def test_eager_attention_takes_an_additive_mask_and_equals_hf() -> None:
    """With attn_implementation='eager' HF adds the mask to the scores: the step passes 0 / finfo.min, not bools."""
    lm = tiny_hf("llama", attn_implementation="eager")
    mg = capture_static_cache(lm, 32)
    prompt = _prompt(5, 0)
    assert torch.equal(generate(mg, prompt, 25, eos_token_ids=[]), _hf(lm, prompt, 25, eos_token_id=None))
