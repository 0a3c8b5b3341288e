"""GPT: shapes/gradients per mixer, fx + export capture, causality, config rules, loss and param groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fxforge.models.afno import AFNO1D
from fxforge.models.gpt import GPT, CausalSelfAttention, GPTConfig, lm_loss, param_groups

VOCAB = 64


def make(mixer: str = "attn", **overrides: object) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, sequence_length=32, n_layer=2, n_head=2, n_embd=32, mixer=mixer,
               afno_num_blocks=4)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))  # type: ignore[arg-type]


VARIANTS = [("attn", "causal"), ("afno", "causal"), ("afno", "pad2n"), ("afno", "none")]


@pytest.mark.parametrize(("mixer", "causality"), VARIANTS)
def test_shapes_and_gradients(mixer: str, causality: str) -> None:
    model = make(mixer, afno_causality=causality)
    idx = torch.randint(0, VOCAB, (2, 20))
    logits = model(idx)
    assert logits.shape == (2, 20, VOCAB)
    loss = lm_loss(logits[:, :-1], idx[:, 1:])
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=0.3)  # near-uniform at init
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    assert model(torch.randint(0, VOCAB, (1, 32))).shape == (1, 32, VOCAB)  # full sequence_length


def test_structure_bias_wpe_and_mixers() -> None:
    attn, afno = make("attn"), make("afno")
    assert attn.wpe is None and isinstance(afno.wpe, nn.Embedding)
    assert afno.wpe.weight.shape == (32, 32)
    assert isinstance(attn.blocks[0].mixer, CausalSelfAttention)
    assert isinstance(afno.blocks[0].mixer, AFNO1D) and afno.blocks[0].mixer.causality == "causal"
    assert all(m.bias is None for m in attn.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)))
    biased = make("attn", bias=True)
    assert all(m.bias is not None for m in biased.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)))
    assert attn.blocks[0].mixer_scale == pytest.approx(1 / math.sqrt(4))
    assert make("attn", mixer_scale=1.0).blocks[0].mixer_scale == 1.0


@pytest.mark.parametrize(("mixer", "causality"), VARIANTS)
def test_fx_symbolic_trace_and_export_match_eager(mixer: str, causality: str) -> None:
    model = make(mixer, afno_causality=causality).eval()
    idx = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        ref = model(idx)
        gm = torch.fx.symbolic_trace(model)
        torch.testing.assert_close(gm(idx), ref)
        torch.testing.assert_close(gm(idx[:, :9]), model(idx[:, :9]))  # traced graph is length-generic
        ep = torch.export.export(model, (idx,))
        torch.testing.assert_close(ep.module()(idx), ref)


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_export_with_dynamic_sequence_length(mixer: str) -> None:
    model = make(mixer).eval()
    idx = torch.randint(0, VOCAB, (2, 16))
    dim = torch.export.Dim("T", min=2, max=32)
    ep = torch.export.export(model, (idx,), dynamic_shapes=({1: dim},))
    other = torch.randint(0, VOCAB, (2, 27))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(other), model(other))


def _token_leak(model: GPT, t: int = 13) -> tuple[float, float]:
    model = model.double().eval()
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    idx2 = idx.clone()
    idx2[:, t] = (idx2[:, t] + 7) % VOCAB
    with torch.no_grad():
        diff = (model(idx) - model(idx2)).abs()
    return diff[:, :t].max().item(), diff[:, t:].max().item()


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_perturbing_a_token_changes_no_earlier_output(mixer: str) -> None:
    before, after = _token_leak(make(mixer, afno_hard_thresholding_fraction=0.5))
    assert before <= 1e-6
    assert after > 1e-3


def test_pad2n_gpt_leaks_future_tokens() -> None:
    before, _ = _token_leak(make("afno", afno_causality="pad2n", afno_sparsity_threshold=0.0))
    assert before > 1e-4


def test_lm_loss_matches_cross_entropy_and_validates() -> None:
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    expected = nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    with pytest.raises(ValueError, match="disagree"):
        lm_loss(logits, targets[:, :4])


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_param_groups_partition_parameters(mixer: str) -> None:
    model = make(mixer, bias=True)
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]  # type: ignore[union-attr]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    decayed = {id(p) for p in decay["params"]}  # type: ignore[union-attr]
    for name, p in model.named_parameters():
        should = p.dim() >= 2 and "wte" not in name and "wpe" not in name and not name.endswith(("b1", "b2"))
        assert (id(p) in decayed) == should, name
    torch.optim.AdamW(param_groups(model), lr=1e-3)  # accepted by an optimizer
    with pytest.raises(ValueError):
        param_groups(model, weight_decay=-1.0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="mixer"):
        GPTConfig(mixer="rnn")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="afno_num_blocks"):
        GPTConfig(n_embd=36, mixer="afno", afno_num_blocks=8)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="afno_causality"):
        GPTConfig(afno_causality="sometimes")


def test_mixer_scale_scales_only_the_mixer_branch() -> None:
    block = make("attn", mixer_scale=0.0).blocks[0]
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(block(x), x + block.mlp(block.ln2(x)))
    block.mixer_scale = 0.5
    h = x + 0.5 * block.mixer(block.ln1(x))
    torch.testing.assert_close(block(x), h + block.mlp(block.ln2(h)))
