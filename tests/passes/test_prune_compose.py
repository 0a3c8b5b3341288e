"""Pruning composes: masks survive HF-Trainer training and quantization-aware training; a quantized pruned
graph exports and reloads; prune -> shrink -> quantize -> lower int8 runs on the shrunk graph; shrink is
exact on the real MiniLM at two shapes; structured granularities wrap only the layers of their groups."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes.prune import PrunedLinear, QuantizedPrunedLinear, prune_transform_pass, shrink_transform_pass
from fxforge.passes.quantize import Int8Linear

FIXED = {"by": "type", "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 5,
                                             "weight_width": 8, "weight_frac_width": 7}}}
INT8 = {"by": "type", "linear": {"config": {"name": "scaled_integer", "data_in_width": 8, "data_in_dynamic": True,
                                            "data_in_symmetric": False, "weight_width": 8,
                                            "weight_granularity": "per_channel"}}}


def _masks(mg: ForgeGraph) -> dict[str, torch.Tensor]:
    return {n: m.weight_mask.clone() for n, m in mg.model.named_modules() if hasattr(m, "weight_mask")}


def test_hf_trainer_keeps_pruned_weights_exactly_zero(tmp_path: Path) -> None:
    from fxforge.data import get_tokenized_dataset, get_trainer
    from fxforge.models.bert import tiny_bert

    mg = ForgeGraph(tiny_bert(num_hidden_layers=1, max_position_embeddings=32),
                    hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "scope": "global"}})
    masks = _masks(mg)
    before = {n: mg.model.get_submodule(n).weight.detach().clone() for n in masks}
    ds, tok = get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True, max_length=24, limit=8,
                                    test_limit=4)
    trainer = get_trainer(mg.model, ds, tok, output_dir=str(tmp_path), max_steps=3, learning_rate=1e-2,
                          per_device_train_batch_size=4, training_args={"eval_strategy": "no"})
    assert trainer.train().global_step == 3
    moved = 0
    for n, mask in masks.items():
        w = mg.model.get_submodule(n).weight.detach()
        assert (w[~mask] == 0).all(), n  # exactly zero, not small
        moved += int(not torch.equal(w[mask], before[n][mask]))
    assert moved == len(masks)  # the kept weights did train


def test_quantize_keeps_masks_through_qat_and_checkpoints(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "granularity": "row"}})
    masks = _masks(mg)
    mg, info = passes.quantize_transform_pass(mg, FIXED)
    layers = {n: mg.model.get_submodule(n) for n in masks}
    assert all(type(m) is QuantizedPrunedLinear for m in layers.values())
    assert passes.holds("pruned", mg) and passes.holds("quantized", mg)
    # a weight written into a pruned position (e.g. by an optimizer bug) does not leak into the output
    x = torch.randn(2, 32)
    q = layers["classifier"]
    with torch.no_grad():
        ref = q(x)
        q.weight[~masks["classifier"]] = 1.0
        assert torch.equal(q(x), ref)
        q.weight.mul_(masks["classifier"])
    opt = torch.optim.AdamW(mg.model.parameters(), lr=1e-2)
    mg.train()
    for _ in range(3):
        opt.zero_grad()
        mg.model(**bert_inputs()).loss.backward()
        opt.step()
    mg.eval()
    for n, m in layers.items():
        assert (m.weight[~masks[n]] == 0).all(), n
        assert (m.weight_quantizer(m.masked_weight())[~masks[n]] == 0).all(), n
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "qpruned"))
    x = bert_inputs()
    assert torch.equal(back.model(**x).logits, mg.model(**x).logits)
    assert all(torch.equal(back.model.get_submodule(n).weight_mask, masks[n]) for n in masks)


def test_prune_shrink_quantize_lower_int8_on_the_shrunk_graph(tmp_path: Path) -> None:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    for cfg in ({"weight": {"sparsity": 0.5, "granularity": "head"}},
                {"weight": {"sparsity": 0.5, "granularity": "ffn"}}):
        mg, _ = prune_transform_pass(mg, cfg)
    small, info = shrink_transform_pass(mg)
    assert info.params_after < info.params_before
    x = bert_inputs(labels=False, batch=4, seq=16)
    with torch.no_grad():
        ref = small(**x).logits
    small, _ = passes.quantize_transform_pass(small, INT8)
    small, low = passes.lower_int8_transform_pass(small, {"strict": True, "backend": "fbgemm"})
    lowered = [n for n, m in small.model.named_modules() if isinstance(m, Int8Linear)]
    assert low.lowered == len(lowered) == 14
    ffn = small.model.get_submodule("bert.encoder.layer.0.intermediate.dense")
    assert isinstance(ffn, Int8Linear) and ffn.weight_int8.shape == (32, 32)  # 64 -> 32 FFN units, int8
    with torch.no_grad():
        out = small(**x).logits
    assert (out - ref).abs().max() <= 0.1 * ref.abs().max() + 1e-3
    back = ForgeGraph.from_checkpoint(small.export(tmp_path / "int8"))
    with torch.no_grad():
        assert torch.equal(back(**x).logits, out)


def test_structured_granularities_wrap_only_their_groups() -> None:
    bert = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])
    heads, _ = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "head"}})
    wrapped = sorted(n for n, m in heads.model.named_modules() if isinstance(m, PrunedLinear))
    assert wrapped == sorted(f"bert.encoder.layer.{i}.attention.self.{p}" for i in (0, 1)
                             for p in ("query", "key", "value"))
    assert type(heads.model.get_submodule("classifier")) is nn.Linear


def test_minilm_shrinks_exactly_at_two_shapes(minilm_classifier: nn.Module) -> None:
    mg = ForgeGraph(copy.deepcopy(minilm_classifier), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, hinfo = prune_transform_pass(mg, {"weight": {"sparsity": 1 / 3, "granularity": "head"}})
    mg, finfo = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "granularity": "ffn"}})
    assert (hinfo.units_pruned, hinfo.units_total) == (24, 72)  # 4 of 12 heads in each of 6 layers
    assert (finfo.units_pruned, finfo.units_total) == (4608, 9216)  # half of 1536 units in each of 6 layers
    small, info = shrink_transform_pass(mg.copy())
    assert set(info.heads.values()) == {(12, 8)}
    assert small.model.get_submodule("bert.encoder.layer.3.attention.self.query").weight.shape == (256, 384)
    assert small.model.get_submodule("bert.encoder.layer.3.output.dense").weight.shape == (384, 768)
    vocab = minilm_classifier.config.vocab_size
    with torch.no_grad():
        for batch, seq in ((2, 9), (3, 20)):
            x = bert_inputs(vocab=vocab, batch=batch, seq=seq, labels=False)
            assert (small(**x).logits - mg(**x).logits).abs().max() <= 1e-5
