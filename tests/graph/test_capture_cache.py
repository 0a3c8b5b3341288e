"""Architecture cache: the same architecture with other weights hits (outputs follow the new weights);
anything that changes the architecture or the input spec misses; what the key cannot describe is not cached."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs

from fxforge import ForgeGraph, passes
from fxforge.graph.capture import CACHE_HIT_NOTE
from fxforge.graph.capture_cache import capture_cache_size, clear_capture_cache
from fxforge.models.bert import tiny_bert

NAMES = ["input_ids", "attention_mask", "labels"]


def _bert(seed: int = 0, heads: int = 4) -> nn.Module:
    return tiny_bert(vocab_size=100, num_attention_heads=heads, max_position_embeddings=64, seed=seed).eval()


def _hit(mg: ForgeGraph) -> bool:
    return CACHE_HIT_NOTE in mg.capture_notes


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    clear_capture_cache()


def _logits(mg: ForgeGraph | nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return mg(**inputs).logits


def test_other_weights_hit_and_outputs_follow_them() -> None:
    a, b = _bert(seed=0), _bert(seed=1)
    ga = ForgeGraph(a, hf_input_names=NAMES)
    gb = ForgeGraph(b, hf_input_names=NAMES)
    assert not _hit(ga) and _hit(gb)
    fresh = ForgeGraph(b, hf_input_names=NAMES, cache=False)
    assert gb.model.code == fresh.model.code
    for inputs in (bert_inputs(batch=3, seq=11), bert_inputs(batch=1, seq=20)):
        assert (_logits(gb.eval(), inputs) - _logits(b, inputs)).abs().max() <= 1e-5
        assert (_logits(ga.eval(), inputs) - _logits(a, inputs)).abs().max() <= 1e-5
        assert not torch.allclose(_logits(gb, inputs), _logits(a, inputs))
    # a hit, like a fresh capture, owns copies of b's modules and weights (share_weights=True shares the weights)
    q = "bert.encoder.layer.0.attention.self.query"
    assert gb.model.get_submodule(q) is not b.get_submodule(q)
    assert gb.model.get_submodule(q).weight.data_ptr() != b.get_submodule(q).weight.data_ptr()
    c = _bert(seed=2)  # (b's eager forward with labels above set b.config.problem_type: another key)
    shared = ForgeGraph(c, hf_input_names=NAMES, share_weights=True)
    assert _hit(shared) and shared.model.get_submodule(q).weight is c.get_submodule(q).weight


def test_changed_config_misses_even_with_equal_parameter_shapes() -> None:
    a, b = _bert(heads=4), _bert(heads=2)  # same parameter shapes, different attention
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    ForgeGraph(a, hf_input_names=NAMES)
    gb = ForgeGraph(b, hf_input_names=NAMES)
    assert not _hit(gb)
    inputs = bert_inputs()
    assert (_logits(gb.eval(), inputs) - _logits(b, inputs)).abs().max() <= 1e-5


def test_a_hit_orders_parameters_and_buffers_as_a_fresh_capture() -> None:
    ForgeGraph(_bert(seed=0), hf_input_names=NAMES[:2])
    hit = ForgeGraph(_bert(seed=1), hf_input_names=NAMES[:2])
    fresh = ForgeGraph(_bert(seed=1), hf_input_names=NAMES[:2], cache=False)
    assert _hit(hit) and not _hit(fresh)
    assert list(hit.model.state_dict()) == list(fresh.model.state_dict())
    assert [n for n, _ in hit.model.named_modules()] == [n for n, _ in fresh.model.named_modules()]


def test_attention_implementation_is_part_of_the_key() -> None:
    """HF keeps it out of the config JSON (a private field): eager and SDPA attention trace different graphs."""
    sdpa, eager = _bert(), _bert()
    eager.config._attn_implementation = "eager"
    ForgeGraph(sdpa, hf_input_names=NAMES)
    ge = ForgeGraph(eager, hf_input_names=NAMES)
    assert not _hit(ge)
    assert not any("scaled_dot_product" in str(n.target) for n in ge.model.graph.nodes)


def test_input_spec_settings_and_mode_are_part_of_the_key() -> None:
    a = _bert()
    ForgeGraph(a, hf_input_names=NAMES)
    # tracing with labels sets config.problem_type (HF does that on a first forward), on the traced copy only
    assert a.config.problem_type is None
    assert _hit(ForgeGraph(a, hf_input_names=NAMES))
    a.config.problem_type = "single_label_classification"  # a changed config misses
    assert not _hit(ForgeGraph(a, hf_input_names=NAMES))
    assert not _hit(ForgeGraph(a, hf_input_names=["input_ids", "attention_mask"]))
    assert not _hit(ForgeGraph(a, hf_input_names=NAMES, dynamic=False))
    a.train()
    assert not _hit(ForgeGraph(a, hf_input_names=NAMES))
    a.eval()
    assert _hit(ForgeGraph(a, hf_input_names=NAMES))


class _Scaled(nn.Module):
    def __init__(self, scale: float, act: object = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        return self.act(y) if callable(self.act) else y


def test_plain_attributes_are_keyed_and_unknown_values_disable_the_cache() -> None:
    x = torch.randn(2, 4)
    ForgeGraph(_Scaled(2.0), x)
    three = _Scaled(3.0)
    g = ForgeGraph(three, x)
    assert not _hit(g) and torch.allclose(g(x), three(x))
    assert _hit(ForgeGraph(_Scaled(3.0), x))
    size = capture_cache_size()
    lam = _Scaled(3.0, act=lambda t: t + 1)
    g = ForgeGraph(lam, x)
    assert not _hit(g) and any("capture cache not used" in n and "'act'" in n for n in g.capture_notes)
    assert capture_cache_size() == size and torch.allclose(g(x), lam(x))
    hooked = _Scaled(3.0)
    hooked.lin.register_forward_hook(lambda m, i, o: o * 0)
    assert not _hit(ForgeGraph(hooked, x))


def test_transforming_a_hit_leaves_the_cache_clean() -> None:
    ForgeGraph(_bert(), hf_input_names=NAMES)
    hit = ForgeGraph(_bert(seed=1), hf_input_names=NAMES)
    hit, _ = passes.insert_lora_adapter_transform_pass(hit, {"rank": 2})
    again = ForgeGraph(_bert(seed=2), hf_input_names=NAMES)
    assert _hit(again)
    assert not any("lora" in type(m).__name__.lower() for m in again.model.modules())
