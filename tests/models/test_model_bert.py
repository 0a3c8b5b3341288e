"""BERT helpers: tiny random model, the offline MiniLM package, and the hub-name fallback."""

from __future__ import annotations

import pytest
import torch

from fxforge.models.bert import (
    load_sequence_classifier,
    load_tokenizer,
    minilm_for_sequence_classification,
    minilm_path,
    tiny_bert,
)


def test_tiny_bert_shapes_and_gradients() -> None:
    model = tiny_bert(num_labels=3, vocab_size=100)
    assert model.config.num_labels == 3 and model.config.hidden_size == 32
    ids = torch.randint(0, 100, (2, 9))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss.ndim == 0
    out.loss.backward()
    assert model.classifier.weight.grad is not None
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_tiny_bert_is_seeded_and_validates() -> None:
    a, b = tiny_bert(seed=3), tiny_bert(seed=3)
    torch.testing.assert_close(a.classifier.weight, b.classifier.weight)
    with pytest.raises(ValueError):
        tiny_bert(num_labels=0)
    with pytest.raises(ValueError, match="divisible"):
        tiny_bert(hidden_size=30, num_attention_heads=4)


def test_minilm_offline_package_loads_with_a_fresh_head() -> None:
    assert (minilm_path() / "model.safetensors").is_file()
    model = minilm_for_sequence_classification(num_labels=2).eval()
    tok = load_tokenizer("minilm")
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    enc = tok(["a wonderful film", "dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    assert out.logits.shape == (2, 2) and torch.isfinite(out.logits).all()
    # the encoder really is pretrained: its word embeddings are not at their N(0, 0.02) init scale
    assert model.bert.embeddings.word_embeddings.weight.std() > 0.03


def test_unreachable_checkpoint_falls_back_to_minilm(capsys: pytest.CaptureFixture[str]) -> None:
    model = load_sequence_classifier("fxforge-tests/no-such-model", num_labels=2)
    tok = load_tokenizer("fxforge-tests/no-such-model")
    printed = capsys.readouterr().out
    assert printed.count("falling back to the offline MiniLM") == 2
    assert model.config.hidden_size == 384 and tok.vocab_size == 30522


def test_minilm_names_load_offline_without_a_notice(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("sentence-transformers/all-MiniLM-L6-v2", "minilm", "all-MiniLM-L6-v2"):
        assert load_tokenizer(name).vocab_size == 30522
    assert "falling back" not in capsys.readouterr().out
