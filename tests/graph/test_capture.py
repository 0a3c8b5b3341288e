"""Capture: one IR whatever the frontend, eager-equal in eval, trainable, HF structure kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_agru, make_gpt

from fxforge import CaptureError, ForgeGraph
from fxforge.graph.modules import ScaledDotProductAttention


def _call_module_types(mg: ForgeGraph) -> dict[str, type[nn.Module]]:
    mods = dict(mg.model.named_modules())
    return {str(n.target): type(mods[str(n.target)]) for n in mg.nodes if n.op == "call_module"}


def test_tiny_bert_uses_export_and_keeps_hf_names(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"])
    assert mg.frontend == "export"
    types = _call_module_types(mg)
    for path, cls in [("bert.encoder.layer.0.attention.self.query", nn.Linear),
                      ("bert.encoder.layer.1.output.dense", nn.Linear),
                      ("bert.embeddings.word_embeddings", nn.Embedding),
                      ("bert.embeddings.LayerNorm", nn.LayerNorm),
                      ("bert.encoder.layer.0.output.dropout", nn.Dropout),
                      ("classifier", nn.Linear)]:
        assert types[path] is cls, path
    # Every nn.Linear of the HF model is a call_module node under its own name.
    linears = {n for n, m in tiny_bert.named_modules() if isinstance(m, nn.Linear)}
    assert linears == {p for p, c in types.items() if c is nn.Linear}
    assert not any(n.op == "call_function" and "linear" in str(n.target) for n in mg.nodes)


def test_tiny_bert_eval_equals_eager_with_other_shapes(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    inputs = bert_inputs(batch=3, seq=11)
    got, want = mg(**inputs), tiny_bert(**inputs)
    assert type(got).__name__ == "SequenceClassifierOutput"
    assert (got.logits - want.logits).abs().max() <= 1e-5
    assert (got.loss - want.loss).abs() <= 1e-5
    # Without labels the HF model returns no loss: so does the graph captured without them.
    mg2 = ForgeGraph(tiny_bert).eval()
    out = mg2(**bert_inputs(labels=False))
    assert out.loss is None if hasattr(out, "loss") else True
    assert (out.logits - tiny_bert(**bert_inputs(labels=False)).logits).abs().max() <= 1e-5


def test_train_and_eval_switch_dropout(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask"])
    assert not mg.model.training  # the model was in eval: so is its graph
    assert any(isinstance(m, ScaledDotProductAttention) and m.dropout_p > 0 for m in mg.model.modules())
    inputs = bert_inputs(labels=False)
    mg.train()
    a, b = mg(**inputs).logits, mg(**inputs).logits
    assert (a - b).abs().max() > 1e-4  # dropout active
    mg.eval()
    c, d = mg(**inputs).logits, mg(**inputs).logits
    assert torch.equal(c, d)
    assert not tiny_bert.training  # capture restored the user's model mode


def test_captured_bert_trains(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"]).train()
    inputs = bert_inputs(batch=4, seq=9)
    opt = torch.optim.AdamW(mg.model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = mg(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    q = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert q.weight.grad is not None and q.weight.grad.abs().sum() > 0
    assert losses[-1] < losses[0]


def test_hf_trainer_trains_captured_graph(tiny_bert: nn.Module, tmp_path) -> None:
    from transformers import Trainer, TrainingArguments

    mg = ForgeGraph(tiny_bert, hf_input_names=["input_ids", "attention_mask", "labels"])
    rows = [{k: v[i] for k, v in bert_inputs(batch=8, seq=12).items()} for i in range(8)]
    before = mg.model.get_submodule("classifier").weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
    result = Trainer(model=mg.model, args=args, train_dataset=rows).train()
    assert result.global_step == 2 and result.training_loss > 0
    assert not torch.equal(before, mg.model.get_submodule("classifier").weight)


def test_pretrained_minilm_classifier(minilm_classifier: nn.Module) -> None:
    mg = ForgeGraph(minilm_classifier, hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    inputs = bert_inputs(vocab=minilm_classifier.config.vocab_size, batch=2, seq=20)
    got, want = mg(**inputs), minilm_classifier(**inputs)
    assert (got.logits - want.logits).abs().max() <= 1e-5
    assert (got.loss - want.loss).abs() <= 1e-5
    assert isinstance(mg.model.get_submodule("bert.encoder.layer.5.attention.self.value"), nn.Linear)


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_gpt_captures_with_fx(mixer: str) -> None:
    model = make_gpt(mixer)
    idx = torch.randint(0, 64, (2, 16))
    mg = ForgeGraph(model, example_inputs=idx)
    assert mg.frontend == "fx"
    assert (mg(idx) - model(idx)).abs().max() <= 1e-5
    longer = torch.randint(0, 64, (3, 24))
    assert (mg(longer) - model(longer)).abs().max() <= 1e-5
    types = _call_module_types(mg)
    assert types["lm_head"] is nn.Linear and types["wte"] is nn.Embedding
    assert types["blocks.0.ln1"] is nn.LayerNorm


def test_gpt_export_frontend_gives_the_same_ir_names() -> None:
    model = make_gpt("attn")
    idx = torch.randint(0, 64, (2, 16))
    fx_mg = ForgeGraph(model, example_inputs=idx, frontend="fx")
    ex_mg = ForgeGraph(model, example_inputs=idx, frontend="export")
    assert ex_mg.frontend == "export"
    assert _call_module_types(fx_mg) == _call_module_types(ex_mg)
    assert (ex_mg(idx) - model(idx)).abs().max() <= 1e-5


def test_gru_loop_falls_back_to_export() -> None:
    model = make_agru()
    x = torch.randn(4, 8, 8)
    mg = ForgeGraph(model, example_inputs=x)
    assert mg.frontend == "export"
    assert mg.capture_notes and "fx" in mg.capture_notes[0]
    assert (mg(x) - model(x)).abs().max() <= 1e-5
    x7 = torch.randn(7, 8, 8)
    assert torch.allclose(mg(x7), model(x7), atol=1e-5)  # batch is dynamic
    assert _call_module_types(mg)["head"] is nn.Linear


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _DataDependent()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_untraceable_model_error_names_module_and_remedy() -> None:
    with pytest.raises(CaptureError) as info:
        ForgeGraph(_Outer(), frontend="fx")
    msg = str(info.value)
    assert "inner" in msg and "_DataDependent" in msg and "if x.sum() > 0" in msg
    assert "leaf_modules=[_DataDependent]" in msg and "frontend='export'" in msg


def test_leaf_module_keeps_untraceable_submodule_whole() -> None:
    model = _Outer()
    mg = ForgeGraph(model, leaf_modules=[_DataDependent])
    assert mg.frontend == "fx"
    assert _call_module_types(mg)["inner"] is _DataDependent
    x = torch.randn(3, 4)
    assert torch.allclose(mg(x), model(x))


def clamp_big(x: torch.Tensor) -> torch.Tensor:
    return x if x.max() < 100 else x.clamp(max=100)


class _UsesFn(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamp_big(x) * 2


def test_leaf_function() -> None:
    with pytest.raises(CaptureError):
        ForgeGraph(_UsesFn(), frontend="fx")
    mg = ForgeGraph(_UsesFn(), frontend="fx", leaf_functions=[clamp_big])
    assert any(n.op == "call_function" and n.target is clamp_big for n in mg.nodes)
    x = torch.randn(2, 3) * 300
    assert torch.equal(mg(x), _UsesFn()(x))
    with pytest.raises(ValueError, match="start with '_'"):
        ForgeGraph(_UsesFn(), leaf_functions=[_private_fn])


def _private_fn(x: torch.Tensor) -> torch.Tensor:
    return x


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="allowed"):
        ForgeGraph(_Outer(), frontend="jit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hf_input_names"):
        ForgeGraph(_Outer(), hf_input_names=["input_ids"])
    with pytest.raises(TypeError):
        ForgeGraph("not a model")  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match="example_inputs"):
        ForgeGraph(make_agru())


def test_unknown_hf_input_name(tiny_bert: nn.Module) -> None:
    with pytest.raises(ValueError, match="allowed"):
        ForgeGraph(tiny_bert, hf_input_names=["input_ids", "images"])
    with pytest.raises(ValueError, match="mixes pixel_values with text inputs"):
        ForgeGraph(tiny_bert, hf_input_names=["input_ids", "pixel_values"])


class _Fast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no fast path for this input")


class _TriesFastThenSlow(nn.Module):
    """A forward that falls back to an untraceable path while handling the fast path's (caught) error."""

    def __init__(self) -> None:
        super().__init__()
        self.fast = _Fast()
        self.slow = _DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.fast(x)
        except NotImplementedError:
            return self.slow(x)


def test_error_raised_while_handling_another_names_its_own_site() -> None:
    with pytest.raises(CaptureError) as info:
        ForgeGraph(_TriesFastThenSlow(), frontend="fx")
    msg = str(info.value)
    assert "module 'slow' (_DataDependent)" in msg and "if x.sum() > 0" in msg
    assert "'fast'" not in msg and "no fast path" not in msg and " at capture.py" not in msg
