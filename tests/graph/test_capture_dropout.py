"""Dropout survives the fast capture: SDPA's attention dropout is traced by a cheap stand-in op and lifted into a
switchable module (graph/dropout_tracing), the graph equals the one a plain train-mode export gives, dropout is
active in train mode at two shapes and off in eval (equal to eager), and LoRA fine-tuning with dropout trains."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hf_tiny import hf_inputs, tiny_hf
from torch._subclasses.fake_tensor import FakeTensorMode

from fxforge import ForgeGraph, passes
from fxforge.graph import capture as capture_module
from fxforge.graph.dropout_tracing import DropoutTracing, bind_sdpa
from fxforge.graph.modules import ScaledDotProductAttention

NAMES = ["input_ids", "attention_mask", "labels"]
SHAPES = [(3, 11), (1, 7)]
ATTN_P = 0.3
SDPA_OPS = ("fxforge::sdpa_dropout", "aten::scaled_dot_product_attention")  # by name: op objects may be renewed


def _op_name(target: object) -> str | None:
    return target.name() if isinstance(target, torch._ops.OpOverload) else None


def _bert(attn_p: float = ATTN_P, hidden_p: float = 0.0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=hidden_p,
                        attention_probs_dropout_prob=attn_p)
    return BertForSequenceClassification(config).eval()


def _model(family: str) -> nn.Module:
    """Only the attention dropout on: a train-mode difference can come from nowhere but the restored SDPA p."""
    if family == "bert":
        return _bert()
    return tiny_hf("gpt2", attn_pdrop=ATTN_P, resid_pdrop=0.0, embd_pdrop=0.0)


def _inputs(family: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    inputs = hf_inputs("gpt2", batch, seq)
    if family == "bert":
        inputs["labels"] = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(2))
    return inputs


def _sdpa_ps(mg: ForgeGraph) -> list[float]:
    return [m.dropout_p for m in mg.model.modules() if isinstance(m, ScaledDotProductAttention)]


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_attention_dropout_active_in_train_off_in_eval_at_two_shapes(family: str) -> None:
    model = _model(family)
    mg = ForgeGraph(model, hf_input_names=NAMES, cache=False)
    assert _sdpa_ps(mg) == [ATTN_P, ATTN_P]  # one per layer, the model's probability
    assert not any("traced the fast way" in n for n in mg.capture_notes)
    assert not any(n.op == "call_function" and "scaled_dot_product" in str(n.target) for n in mg.nodes)
    for batch, seq in SHAPES:
        inputs = _inputs(family, batch, seq)
        mg.train()
        a, b = mg(**inputs).logits, mg(**inputs).logits
        assert a.shape[0] == batch and (a - b).abs().max() > 1e-4  # attention dropout draws new masks
        mg.eval()
        with torch.no_grad():
            got, again, want = mg(**inputs), mg(**inputs), model(**inputs)
        assert torch.equal(got.logits, again.logits)
        assert (got.logits - want.logits).abs().max() <= 1e-5
        assert (got.loss - want.loss).abs() <= 1e-5
    assert not model.training


def test_hidden_dropout_modules_follow_train_and_eval() -> None:
    model = _bert(attn_p=0.0, hidden_p=0.2)
    mg = ForgeGraph(model, hf_input_names=NAMES, cache=False)
    drops = [m for m in mg.model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(m.p == 0.2 for m in drops) and _sdpa_ps(mg) == []
    inputs = _inputs("bert", 3, 11)
    mg.train()
    assert (mg(**inputs).logits - mg(**inputs).logits).abs().max() > 1e-4
    mg.eval()
    assert torch.equal(mg(**inputs).logits, mg(**inputs).logits)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_same_graph_as_tracing_sdpa_with_its_dropout(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in ops' layouts match the real train-mode calls: later contiguous/view calls trace the same way."""
    def build() -> nn.Module:  # attention and hidden dropout on
        return _bert(hidden_p=0.1) if family == "bert" else tiny_hf("gpt2", attn_pdrop=ATTN_P)

    fast = ForgeGraph(build(), hf_input_names=NAMES, cache=False)
    monkeypatch.setattr(capture_module, "DropoutTracing", contextlib.nullcontext)
    slow = ForgeGraph(build(), hf_input_names=NAMES, cache=False)
    assert slow.model.code == fast.model.code
    assert _sdpa_ps(slow) == _sdpa_ps(fast) == [ATTN_P, ATTN_P]
    drops = [(n, m.p) for n, m in fast.model.named_modules() if isinstance(m, nn.Dropout)]
    assert len(drops) >= 5 and drops == [(n, m.p) for n, m in slow.model.named_modules() if isinstance(m, nn.Dropout)]


class _TwoAttentions(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.25 if self.training else 0.0, is_causal=True)
        return F.scaled_dot_product_attention(a, q, q, None, 0.0)


def test_tracing_redirects_only_constant_dropout_calls() -> None:
    tracing = DropoutTracing()
    with tracing:
        gm = torch.export.export(_TwoAttentions(), (torch.randn(2, 2, 5, 4),), strict=False).module()
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and _op_name(n.target) in SDPA_OPS]
    assert [_op_name(n.target) for n in calls] == list(SDPA_OPS)
    assert bind_sdpa(calls[0].args, calls[0].kwargs)["dropout_p"] == 0.25 and tracing.redirected == 1
    q = torch.randn(2, 2, 5, 4)
    with DropoutTracing() as t, torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert t.redirected == 0  # kept in an autocast region normalisation does not inline


class _Dropouts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x.transpose(0, 1), 0.4, self.training)  # redirected in training
        y = F.dropout(y, 0.2, False)  # never active: stays as it is
        return F.dropout(y.contiguous(), 0.1, self.training, inplace=True)  # in place: stays


def test_tracing_redirects_training_dropout_only() -> None:
    tracing = DropoutTracing()
    with tracing:
        gm = torch.export.export(_Dropouts().train(), (torch.randn(3, 5),), strict=False).module()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "dropout" in str(n.target)]
    assert ops[0] == torch.ops.fxforge.dropout.default and torch.ops.fxforge.dropout.default not in ops[1:]
    assert tracing.redirected == 1
    x = torch.randn(4, 6).t()
    with FakeTensorMode() as mode:
        fake = torch.ops.fxforge.dropout(mode.from_tensor(x), 0.3)
    assert fake.stride() == F.dropout(x, 0.3, True).stride() == x.stride()


@pytest.mark.parametrize("frontend", ["export", "fx"])
def test_only_dropout_the_model_can_switch_on_becomes_a_module(frontend: str) -> None:
    """Training dropout (functional and in place) switches with the graph; training=False dropout stays off."""
    model = _Dropouts().eval()
    mg = ForgeGraph(model, example_inputs=(torch.randn(3, 5),), frontend=frontend, cache=False)
    assert sorted(m.p for m in mg.model.modules() if isinstance(m, nn.Dropout)) == [0.1, 0.4]
    for shape in ((4, 6), (2, 9)):
        x = torch.randn(shape)
        mg.train()
        assert (mg(x) - mg(x)).abs().max() > 1e-4
        mg.eval()
        assert torch.equal(mg(x), model(x))


def test_tracing_is_per_thread_and_restores_torch_functions() -> None:
    originals = (F.scaled_dot_product_attention, F.dropout)
    x = torch.randn(64, 64)
    seen: list[torch.Tensor] = []
    with DropoutTracing() as outer:
        with DropoutTracing() as inner:
            worker = threading.Thread(target=lambda: seen.append(F.dropout(x, 0.5, True)))
            worker.start()
            worker.join()
        assert inner.redirected == 0 and outer.redirected == 0  # the other thread called the real dropout
        assert (seen[0] == 0).any() and torch.allclose(seen[0][seen[0] != 0], 2 * x[seen[0] != 0])
        assert (F.scaled_dot_product_attention, F.dropout) != originals
    assert (F.scaled_dot_product_attention, F.dropout) == originals


@pytest.mark.parametrize("shapes", [((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6)), ((3, 5, 8), (3, 5, 8), (3, 5, 8)),
                                    ((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8))])
def test_stand_in_shape_rule_matches_sdpa_with_dropout(shapes: tuple[tuple[int, ...], ...]) -> None:
    q, k, v = (torch.randn(s, requires_grad=True) for s in shapes)
    gqa = shapes[0][-3] != shapes[1][-3]
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=gqa)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        got = torch.ops.fxforge.sdpa_dropout(fq, fk, fv, None, 0.3, False, None, gqa)
    assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype


def test_non_hf_model_attention_dropout_switches_at_two_shapes() -> None:
    model = _TwoAttentions().eval()
    mg = ForgeGraph(model, example_inputs=(torch.randn(2, 2, 5, 4),), frontend="export", cache=False)
    assert _sdpa_ps(mg) == [0.25]
    for shape in ((3, 2, 7, 4), (1, 4, 3, 8)):
        q = torch.randn(shape)
        mg.train()
        assert (mg(q) - mg(q)).abs().max() > 1e-4
        mg.eval()
        assert (mg(q) - model(q)).abs().max() <= 1e-5


def test_lora_fine_tuning_with_attention_dropout_trains() -> None:
    mg = ForgeGraph(_model("gpt2"), hf_input_names=NAMES, cache=False)
    mg, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "alpha": 4.0})
    assert len(info.adapted) >= 4
    mg.train()
    trainable = [p for p in mg.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-2)
    inputs = _inputs("gpt2", 4, 9)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = mg(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert _sdpa_ps(mg) == [ATTN_P, ATTN_P]
    assert all(p.grad is not None for p in trainable)
    assert sum(losses[-3:]) < sum(losses[:3])
