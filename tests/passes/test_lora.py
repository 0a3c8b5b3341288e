"""LoRA insertion and fusion on real models: no-op at insertion, biases kept, clear errors, PEFT-equal merge."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes.transform.lora import LoraLinear, LoraRecord, lora_layers

HF_NAMES = ["input_ids", "attention_mask", "labels"]
N_LINEAR = 14  # tiny BERT: 6 per layer x 2, pooler, classifier


@pytest.fixture(scope="module")
def bert_graph() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()


@pytest.fixture
def mg(bert_graph: ForgeGraph) -> ForgeGraph:
    return bert_graph.copy()


def _perturb_adapters(graph: ForgeGraph, scale: float = 0.05) -> None:
    """Stand-in for training: give every B (and A) non-zero values."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, _, m in lora_layers(graph.model):
            m.lora_B.add_(scale * torch.randn(m.lora_B.shape, generator=gen))
            m.lora_A.add_(scale * torch.randn(m.lora_A.shape, generator=gen))


def test_insert_is_a_no_op_and_keeps_frozen_weight_and_bias(mg: ForgeGraph) -> None:
    inputs = bert_inputs()
    with torch.no_grad():
        before = mg(**inputs)
    originals = {str(n.target): mg.model.get_submodule(str(n.target)) for n in mg.nodes
                 if n.op == "call_module" and isinstance(mg.model.get_submodule(str(n.target)), nn.Linear)}
    new, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "alpha": 1.0, "dropout": 0.5})
    assert sorted(info["adapted"]) == sorted(originals) and len(originals) == N_LINEAR  # rank <= classifier's 2
    assert info["scaling"] == pytest.approx(1 / 2)
    for path, layer in originals.items():
        assert mg.model.get_submodule(path) is layer and layer.weight.requires_grad  # the input graph is unchanged
        lora = new.model.get_submodule(path)
        base = lora.base
        assert isinstance(lora, LoraLinear) and torch.equal(base.weight, layer.weight) and base.bias is not None
        assert torch.equal(base.bias, layer.bias)
        assert not base.weight.requires_grad and not base.bias.requires_grad
        assert lora.lora_A.shape == (2, base.in_features) and lora.lora_B.shape == (base.out_features, 2)
        assert torch.count_nonzero(lora.lora_B) == 0 and lora.lora_A.abs().min() > 0
        bound = 1 / base.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) bound, as PEFT
        assert lora.lora_A.abs().max() <= bound and isinstance(lora.lora_dropout, nn.Dropout)
        assert not lora.training and not lora.lora_dropout.training  # follows the graph's eval mode
    with torch.no_grad():
        after = new(**inputs)
    assert (after.logits - before.logits).abs().max() <= 1e-6
    assert abs(after.loss.item() - before.loss.item()) <= 1e-6
    trainable = {n for n, p in new.model.named_parameters() if p.requires_grad}
    assert trainable == {f"{p}.lora_{x}" for p in originals for x in "AB"}
    assert info["trainable"] == sum(2 * (m.in_features + m.out_features) for m in originals.values())


def test_memory_saving_dropout_path_has_exact_gradients() -> None:
    """Train-mode dropout adapters (mask drawn from a seed, kept as bits): same output and gradients as plain
    autograd."""
    lora = LoraLinear(nn.Linear(12, 7), rank=3, alpha=6.0, dropout=0.3).train()
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(2, 5, 12, requires_grad=True)
    torch.manual_seed(11)
    out = lora(x)
    out.square().sum().backward()
    got = (x.grad.clone(), lora.lora_A.grad.clone(), lora.lora_B.grad.clone())
    x.grad = lora.lora_A.grad = lora.lora_B.grad = None
    torch.manual_seed(11)  # the same dropout mask (seed from the global RNG, own generator), plain autograd
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    dropped = x * torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)).ge_(0.3) / 0.7
    ref = lora.base(x) + 2.0 * nn.functional.linear(nn.functional.linear(dropped, lora.lora_A), lora.lora_B)
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-6)
    for a, b in zip(got, (x.grad, lora.lora_A.grad, lora.lora_B.grad)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)  # same math, other summation order
    assert lora.base.weight.grad is None
    with torch.no_grad():
        assert (lora.eval()(x) - out).abs().max() > 1e-3  # the mask did drop something


def test_dropout_mask_is_drawn_once_and_kept_as_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's dropout draws its mask once, in forward, and keeps it as one bit per element (an 8 x 128 x 384
    input keeps 48 KiB beside itself): backward, where a redraw cost a second random draw, draws nothing."""
    from fxforge.passes.transform import lora_dropout

    draws: list[int] = []
    real = lora_dropout._keep_mask
    monkeypatch.setattr(lora_dropout, "_keep_mask", lambda *a: draws.append(1) or real(*a))
    lora = LoraLinear(nn.Linear(384, 16), rank=4, alpha=8.0, dropout=0.1).train()
    x = torch.randn(8, 128, 384, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lora(x)
    assert draws == [1]
    kept = {t.untyped_storage().data_ptr(): t.nbytes for t in saved if t.dtype == torch.uint8}
    assert sum(kept.values()) == x.numel() // 8
    out.sum().backward()
    assert draws == [1] and x.grad is not None and lora.lora_A.grad is not None
    odd = torch.rand(3, 5, 7) > 0.5  # 105 elements: the last byte is padded
    assert torch.equal(lora_dropout._unpack(lora_dropout._pack(odd), odd), odd)
    assert torch.equal(lora_dropout._unpack(lora_dropout._pack(odd), x[:3, :5, :7]), odd.float())


def test_training_moves_only_the_adapters(mg: ForgeGraph) -> None:
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 4, "targets": {"name": ["query", "value"]},
                                                   "trainable": {"name": "classifier"}})
    frozen = {n: p.detach().clone() for n, p in mg.model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in mg.model.parameters() if p.requires_grad], lr=1e-2)
    mg.train()
    for _ in range(3):
        loss = mg(**bert_inputs()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    mg.eval()
    assert all(torch.equal(p, frozen[n]) for n, p in mg.model.named_parameters() if n in frozen)
    q = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert torch.count_nonzero(q.lora_B) > 0
    assert mg.model.get_submodule("classifier").weight.requires_grad  # modules_to_save, not adapted


def test_selectors_pick_targets(mg: ForgeGraph) -> None:
    g = mg.copy()
    g, info = passes.insert_lora_adapter_transform_pass(g, {"targets": {"name": ["query", "value"]}})
    assert len(info["adapted"]) == 4 and all(p.endswith(("query", "value")) for p in info["adapted"])
    g = mg.copy()
    g, info = passes.insert_lora_adapter_transform_pass(g, {"targets": {"regex": r".*layer\.1\.attention\..*"},
                                                            "exclude": {"name": "key"}})
    assert sorted(info["adapted"]) == sorted(f"bert.encoder.layer.1.attention.{s}"
                                             for s in ("self.query", "self.value", "output.dense"))
    assert {t for _, t in info["skipped"]} == {"ScaledDotProductAttention", "Dropout", "LayerNorm"}
    g = mg.copy()
    g, info = passes.insert_lora_adapter_transform_pass(g, {"targets": nn.Linear, "trainable": {"name": "classifier"},
                                                            "exclude": {"regex": r"bert\.pooler\..*"}})
    assert len(info["adapted"]) == N_LINEAR - 2 and "classifier" not in info["adapted"]
    assert info["trainable_modules"] == ["classifier"]


@pytest.mark.parametrize(("args", "match"), [
    ({"rank": 0}, "'rank' must be a positive int"),
    ({"rank": -2}, "'rank' must be a positive int"),
    ({"rank": 2.5}, "'rank'.*expected type"),
    ({"rank": True}, "'rank'"),
    ({"alpha": 0}, "'alpha' must be"),
    ({"alpha": float("nan")}, "'alpha' must be"),
    ({"dropout": 1.0}, "'dropout' must be a probability"),
    ({"dropout": -0.1}, "'dropout' must be a probability"),
    ({"init": "zeros"}, "'init'.*'kaiming', 'gaussian'"),
    ({"r": 8}, r"unknown pass_args key\(s\) \['r'\]; allowed keys: \['alpha', 'dropout', 'exclude'"),
    ({"lora_alpha": 8}, "allowed keys"),
    ({"targets": {"nmae": "query"}}, "'targets': unknown selector key"),
])
def test_invalid_args_are_clear_errors(mg: ForgeGraph, args: dict, match: str) -> None:
    snapshot = copy.deepcopy(args)
    with pytest.raises(passes.PassArgsError, match=match) as info:
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, args)
    assert "insert_lora_adapter_transform_pass" in str(info.value) and args == snapshot
    assert not lora_layers(mg.model)


def test_no_match_double_insert_and_empty_fuse_are_errors(mg: ForgeGraph) -> None:
    with pytest.raises(passes.PassError, match=r"no nn.Linear layer for LoRA matched.*Linear \(14\)"):
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"targets": {"name": "querry"}})
    with pytest.raises(passes.PassError, match="no nn.Linear layer"):  # selects only LayerNorms
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"targets": {"type": "layer_norm"}})
    with pytest.raises(passes.PassError, match="fuse_lora_weights_transform_pass: requires .lora.*insert_lora"):
        mg, _ = passes.fuse_lora_weights_transform_pass(mg)
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"targets": {"name": "query"}})
    with pytest.raises(passes.PassError, match="already have a LoRA adapter"):
        mg, _ = passes.insert_lora_adapter_transform_pass(mg)
    mg, info = passes.insert_lora_adapter_transform_pass(mg, {"targets": {"name": "key"}})  # other layers: fine
    assert len(lora_layers(mg.model)) == 4 and len(info["adapted"]) == 2


def test_fuse_equals_unfused_and_leaves_plain_linears(mg: ForgeGraph) -> None:
    passes.init_metadata_analysis_pass(mg)
    originals = {n: p.detach().clone() for n, p in mg.model.named_parameters()}
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "alpha": 16.0, "dropout": 0.1})
    node = mg.node("bert_encoder_layer_0_attention_self_query")
    record = get_meta(node).software.get(LoraRecord)
    assert record is not None and record.rank == 2 and record.scaling == 8.0
    assert get_meta(node).common.op == "lora_linear" and get_meta(node).common.module_type.endswith("LoraLinear")
    _perturb_adapters(mg)
    inputs = bert_inputs()
    with torch.no_grad():
        unfused = mg(**inputs).logits
    q = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    expected = q.base.weight + 8.0 * q.lora_B @ q.lora_A
    mg, info = passes.fuse_lora_weights_transform_pass(mg)
    node = mg.node("bert_encoder_layer_0_attention_self_query")  # the fused graph's node
    assert len(info["fused"]) == N_LINEAR and not lora_layers(mg.model)
    fused_q = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    assert type(fused_q) is nn.Linear and torch.allclose(fused_q.weight, expected, atol=1e-7)
    assert torch.equal(fused_q.bias, originals["bert.encoder.layer.0.attention.self.query.bias"])
    assert not any("lora" in n for n, _ in mg.model.named_parameters())
    assert get_meta(node).software.get(LoraRecord) is None and get_meta(node).common.op == "linear"
    assert get_meta(node).common.module_type == "torch.nn.modules.linear.Linear"
    with torch.no_grad():
        fused = mg(**inputs).logits
    assert (fused - unfused).abs().max() <= 1e-5
    # The base Linear objects (shared with the captured model) were never written to.
    assert torch.equal(q.base.weight, originals["bert.encoder.layer.0.attention.self.query.weight"])
    assert [r.name for r in mg.history][-2:] == ["insert_lora_adapter_transform_pass",
                                                 "fuse_lora_weights_transform_pass"]


def test_fused_weights_equal_peft_merge_and_unload() -> None:
    from peft import LoraConfig, get_peft_model

    targets = ["query", "key", "value", "dense"]
    ours = ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()
    ours, _ = passes.insert_lora_adapter_transform_pass(ours, {"rank": 4, "alpha": 8.0, "dropout": 0.1,
                                                     "targets": {"name": targets}})
    _perturb_adapters(ours)
    peft_model = get_peft_model(make_tiny_bert(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                             target_modules=targets))
    layers = lora_layers(ours.model)
    peft_layers = {n.removeprefix("base_model.model."): m for n, m in peft_model.named_modules()
                   if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})}
    assert sorted(peft_layers) == sorted(p for _, p, _ in layers) and len(layers) == 13
    with torch.no_grad():
        for _, path, m in layers:
            assert peft_layers[path].scaling["default"] == m.scaling
            peft_layers[path].lora_A["default"].weight.copy_(m.lora_A)
            peft_layers[path].lora_B["default"].weight.copy_(m.lora_B)
    inputs = bert_inputs()
    peft_model.eval()
    with torch.no_grad():
        assert (peft_model(**inputs).logits - ours(**inputs).logits).abs().max() <= 1e-5
    merged = peft_model.merge_and_unload()
    ours, _ = passes.fuse_lora_weights_transform_pass(ours)
    for _, path, _ in layers:
        a, b = ours.model.get_submodule(path), merged.get_submodule(path)
        assert (a.weight - b.weight).abs().max() <= 1e-6 and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_gpt_attention_afno_and_mlp_linears(mixer: str) -> None:
    model = make_gpt(mixer)
    mg = ForgeGraph(model, example_inputs=torch.randint(0, 64, (2, 16)))
    idx = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = mg(idx)
    mg, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 4, "exclude": {"name": "lm_head"}})
    per_block = ["mixer.c_attn", "mixer.c_proj", "mlp.c_fc", "mlp.c_proj"] if mixer == "attn" else ["mlp.c_fc",
                                                                                                  "mlp.c_proj"]
    assert info["adapted"] == [f"blocks.{i}.{s}" for i in range(2) for s in per_block]
    with torch.no_grad():
        assert (mg(idx) - before).abs().max() <= 1e-6
    mg.train()
    logits = mg(idx)
    nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    grads = {n: p.grad for n, p in mg.model.named_parameters() if p.grad is not None}
    assert set(grads) == {f"{p}.lora_{x}" for p in info["adapted"] for x in "AB"}
    assert all(torch.count_nonzero(g) > 0 for n, g in grads.items() if n.endswith("lora_B"))
    mg.eval()
    _perturb_adapters(mg)
    with torch.no_grad():
        unfused = mg(idx)
        mg, _ = passes.fuse_lora_weights_transform_pass(mg)
        assert (mg(idx) - unfused).abs().max() <= 1e-5


def test_real_minilm_query_key_value_dense(minilm_classifier: nn.Module) -> None:
    model = copy.deepcopy(minilm_classifier)  # the session fixture is shared: never freeze it
    mg = ForgeGraph(model, hf_input_names=HF_NAMES).eval()
    inputs = bert_inputs(vocab=30522, batch=2, seq=24)
    with torch.no_grad():
        before = mg(**inputs).logits
    mg, info = passes.insert_lora_adapter_transform_pass(mg, {"rank": 8, "alpha": 16.0, "targets": {
        "name": ["query", "key", "value", "dense"]}, "trainable": {"name": "classifier"}})
    assert len(info["adapted"]) == 6 * 6 + 1  # q k v o, intermediate, output per layer; pooler
    assert info["trainable_percent"] <= 2.0
    with torch.no_grad():
        assert (mg(**inputs).logits - before).abs().max() <= 1e-6
    _perturb_adapters(mg, scale=0.01)
    with torch.no_grad():
        unfused = mg(**inputs).logits
        mg, _ = passes.fuse_lora_weights_transform_pass(mg)
        assert (mg(**inputs).logits - unfused).abs().max() <= 1e-5
    assert all(p.requires_grad for p in minilm_classifier.parameters())


def test_mase_tutorial_rank_on_a_two_label_head_names_the_way_out(mg: ForgeGraph) -> None:
    """MASE tutorial 2 asks rank 6 on every Linear; the 2-label classifier is narrower: say how to proceed."""
    mase = {"rank": 6, "alpha": 1.0, "dropout": 0.5}
    with pytest.raises(passes.PassArgsError, match=r"rank'\] = 6 exceeds .*classifier \(2\)") as err:
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, mase)
    message = str(err.value)
    assert "{'exclude': {'name': ['classifier']}}" in message and "{'trainable': {'name': ['classifier']}}" in message
    assert not lora_layers(mg.model)
    for way_out in ({"exclude": {"name": ["classifier"]}}, {"trainable": {"name": ["classifier"]}}):
        _, info = passes.insert_lora_adapter_transform_pass(mg.copy(), {**mase, **way_out})
        assert len(info.adapted) == N_LINEAR - 1 and "classifier" not in info.adapted
