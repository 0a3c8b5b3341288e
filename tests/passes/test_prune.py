"""prune_transform_pass: MASE config validation, methods, scopes, granularities, masks that survive
training, LoRA fusion, quantization and checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.prune import PrunedLinear, prune_transform_pass


@pytest.fixture
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])


def _masked(mg: ForgeGraph) -> dict[str, PrunedLinear]:
    return {n: m for n, m in mg.model.named_modules() if isinstance(m, PrunedLinear)}


@pytest.mark.parametrize("bad, words", [
    ({"weight": {"sparsity": 1.0}}, "[0, 1)"),
    ({"weight": {"sparsity": -0.1}}, "[0, 1)"),
    ({"weight": {"sparsity": 0.5, "method": "l3"}}, "'random', 'l1', 'l2', 'taylor'"),
    ({"weight": {"sparsity": 0.5, "granularity": "block"}}, "'elementwise', 'row'"),
    ({"weight": {"sparsity": 0.5, "scope": "layer"}}, "'local', 'global'"),
    ({"weight": {"sparsity": 0.5, "spars": 1}}, "allowed keys: ['sparsity', 'method', 'scope', 'granularity']"),
    ({"weight": {"sparsity": 0.5}, "wieght": {}}, "allowed keys"),
    ({"activation": {"sparsity": 0.5, "method": "taylor"}}, "'random', 'l1'"),
    ({"weight": {"sparsity": 0.5, "method": "taylor"}}, "calibration batches"),
    ({}, "'weight' and/or an 'activation'"),
])
def test_bad_config_is_refused(bert: ForgeGraph, bad: dict, words: str) -> None:
    with pytest.raises(PassArgsError, match=None) as err:
        prune_transform_pass(bert, bad)
    assert words in str(err.value)


def test_caller_dict_untouched_and_mase_spelling(bert: ForgeGraph) -> None:
    cfg = {"weight": {"sparsity": 0.5, "method": "l1-norm", "scope": "local"},
           "activation": {"sparsity": 0.3, "method": "l1-norm", "scope": "local"}}
    before = copy.deepcopy(cfg)
    mg, info = prune_transform_pass(bert, cfg)
    assert cfg == before
    assert info.method == "l1" and info.activation_sparsity == 0.3
    for layer in info.layers:  # local: every layer at the target
        assert layer.sparsity == pytest.approx(0.5, abs=1e-3)
        assert layer.kept + round(0.5 * layer.total) == layer.total


@pytest.mark.parametrize("method", ["random", "l1", "l2"])
def test_global_elementwise_hits_the_global_target(bert: ForgeGraph, method: str) -> None:
    mg, info = prune_transform_pass(bert, {"weight": {"sparsity": 0.5, "method": method, "scope": "global"}})
    assert info.sparsity == pytest.approx(0.5, abs=1e-4)
    assert info.kept == sum(m.weight_mask.sum().item() for m in _masked(mg).values())
    per_layer = [x.sparsity for x in info.layers]
    if method != "random":
        assert max(per_layer) - min(per_layer) > 0.02  # one threshold: layers differ
    for m in _masked(mg).values():  # stored weights are zero where masked
        assert (m.weight[~m.weight_mask] == 0).all()
    assert passes.holds("pruned", mg)


def test_l1_removes_the_smallest_weights(bert: ForgeGraph) -> None:
    w = bert.model.get_submodule("classifier").weight.detach().abs().clone()
    mg, _ = prune_transform_pass(bert, {"weight": {"sparsity": 0.5}, "targets": {"name": "classifier"}})
    mask = mg.model.get_submodule("classifier").weight_mask
    assert w[~mask].max() <= w[mask].min()
    assert list(_masked(mg)) == ["classifier"]


def test_selector_matching_nothing_lists_candidates(bert: ForgeGraph) -> None:
    with pytest.raises(PassError, match="candidates: .*Linear"):
        prune_transform_pass(bert, {"weight": {"sparsity": 0.5}, "targets": {"name": "nope"}})


def test_row_head_ffn_granularities(bert: ForgeGraph) -> None:
    mg, info = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "row"}})
    for m in _masked(mg).values():
        rows_off = (~m.weight_mask.any(dim=1))
        assert rows_off.sum() == round(0.5 * m.out_features)
        assert (~m.bias_mask == rows_off).all()
    mg, info = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "head"}})
    assert (info.units_pruned, info.units_total) == (4, 8)  # 2 of 4 heads per layer
    q = mg.model.get_submodule("bert.encoder.layer.0.attention.self.query")
    k = mg.model.get_submodule("bert.encoder.layer.0.attention.self.key")
    heads_off = ~q.weight_mask.any(dim=1).reshape(4, 8).any(dim=1) == False  # noqa: E712
    assert heads_off.sum() == 2 and (q.weight_mask == k.weight_mask).all()
    mg, info = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.25, "granularity": "ffn"}})
    assert sorted(_masked(mg)) == ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.1.intermediate.dense"]
    assert info.units_pruned == 32


def test_heads_on_a_layer_without_heads_and_ffn_on_the_residual(bert: ForgeGraph) -> None:
    with pytest.raises(PassError, match="'bert.encoder.layer.0.intermediate.dense' has no attention heads"):
        prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "head"},
                                           "targets": {"name": "layer.0.intermediate.dense"}})
    with pytest.raises(PassError, match="has no FFN units: its rows cannot be removed: node "):
        prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "ffn"},
                                           "targets": {"name": "layer.0.attention.output.dense"}})


def test_gpt_heads_in_a_fused_qkv_layer() -> None:
    mg = ForgeGraph(make_gpt(n_head=4), example_inputs=torch.randint(0, 64, (2, 16)))
    mg, info = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "granularity": "head", "scope": "global"}})
    assert info.units_total == 8 and info.units_pruned == 4
    m = mg.model.get_submodule("blocks.0.mixer.c_attn")
    per_seg = (~m.weight_mask.any(dim=1)).reshape(3, 4, 8).all(dim=2)  # q, k, v segments x heads
    assert (per_seg[0] == per_seg[1]).all() and (per_seg[1] == per_seg[2]).all()


def test_taylor_uses_calibration_batches(bert: ForgeGraph) -> None:
    batches = [bert_inputs(), bert_inputs(batch=2, seq=7)]
    mg, info = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "method": "taylor",
                                                             "granularity": "ffn"}, "data": batches})
    l1, _ = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5, "granularity": "ffn"}})
    name = "bert.encoder.layer.0.intermediate.dense"
    assert info.units_pruned == 64
    assert not torch.equal(mg.model.get_submodule(name).weight_mask, l1.model.get_submodule(name).weight_mask)
    assert all(p.grad is None for p in mg.model.parameters())


def _removal_estimates(bert: ForgeGraph, batches: list[dict[str, torch.Tensor]], consumer: str,
                       groups: int) -> torch.Tensor:
    """sum over batches of |sum(a * dL/da)| per unit, a = the consumer Linear's input split in ``groups``
    (heads) or per feature: the first-order loss change of zeroing the unit, computed from activations."""
    gm, seen = bert.copy().model.eval(), []
    layer = gm.get_submodule(consumer)

    def keep(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        inputs[0].retain_grad()
        seen.append(inputs[0])

    layer.register_forward_hook(keep)
    total = 0
    for batch in batches:
        seen.clear()
        gm.zero_grad()
        gm(**batch).loss.backward()
        a = seen[0]
        prod = (a * a.grad).sum(tuple(range(a.dim() - 1)))
        total = total + (prod if groups == 0 else prod.reshape(groups, -1).sum(1)).abs()
    return total.detach()


@pytest.mark.parametrize("gran, producer, consumer, groups", [
    ("ffn", "bert.encoder.layer.1.intermediate.dense", "bert.encoder.layer.1.output.dense", 0),
    ("head", "bert.encoder.layer.0.attention.self.value", "bert.encoder.layer.0.attention.output.dense", 4),
])
def test_structured_taylor_removes_the_units_whose_removal_costs_least(bert: ForgeGraph, gran: str, producer: str,
                                                                       consumer: str, groups: int) -> None:
    """A unit's taylor score is the first-order loss change of removing it (|a * dL/da| summed over what it
    feeds the next Linear, per batch): the pass keeps exactly the units with the largest estimates."""
    batches = [bert_inputs(), bert_inputs(batch=2, seq=7)]
    est = _removal_estimates(bert, batches, consumer, groups)
    sparsity = 0.5 if gran == "ffn" else 0.25
    mg, info = prune_transform_pass(bert.copy(), {"weight": {"sparsity": sparsity, "method": "taylor",
                                                             "granularity": gran}, "data": batches})
    kept_rows = mg.model.get_submodule(producer).weight_mask.any(1)
    kept = kept_rows if groups == 0 else kept_rows.reshape(groups, -1).all(1)
    k = int(round(sparsity * est.numel()))
    assert int((~kept).sum()) == k
    assert set(torch.nonzero(~kept).flatten().tolist()) == set(torch.argsort(est)[:k].tolist())
    assert all(p.grad is None for p in mg.model.parameters())


def test_activation_pruning_is_off_by_default_and_masks_inputs(bert: ForgeGraph) -> None:
    x = bert_inputs()
    ref = bert.model(**x)
    mg, _ = prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.0}})
    assert torch.allclose(mg.model(**x).logits, ref.logits, atol=1e-6)
    assert all(m.act_sparsity == 0 for m in _masked(mg).values())
    seen: list[torch.Tensor] = []
    mg, _ = prune_transform_pass(bert.copy(), {"activation": {"sparsity": 0.5}, "targets": {"name": "classifier"}})
    layer = mg.model.get_submodule("classifier")
    layer.register_forward_hook(lambda m, i, o: seen.append(m.masked_input(i[0])))
    mg.model(**x)
    assert (seen[0] == 0).float().mean() >= 0.5


def test_masked_weights_stay_zero_through_training_lora_quantize_and_export(bert: ForgeGraph, tmp_path) -> None:
    mg, _ = prune_transform_pass(bert, {"weight": {"sparsity": 0.5, "scope": "global"}})
    masks = {n: m.weight_mask.clone() for n, m in _masked(mg).items()}
    opt = torch.optim.AdamW(mg.model.parameters(), lr=1e-2, weight_decay=0.1)
    mg.train()
    for _ in range(4):
        opt.zero_grad()
        mg.model(**bert_inputs()).loss.backward()
        opt.step()
    mg.eval()
    for n, m in _masked(mg).items():
        assert (m.weight[~masks[n]] == 0).all(), n
    path = mg.export(tmp_path / "pruned")
    back = ForgeGraph.from_checkpoint(path)
    x = bert_inputs()
    assert torch.equal(back.model(**x).logits, mg.model(**x).logits)
    assert all(torch.equal(_masked(back)[n].weight_mask, masks[n]) for n in masks)
    lora, _ = passes.insert_lora_adapter_transform_pass(mg.copy(), {"rank": 2})
    for _, m in lora.model.named_modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B)
    with torch.no_grad():  # the adapters' update obeys the masks, so fusing them is exact (the fuse contract)
        unfused = lora.model(**x).logits
    fused, _ = passes.fuse_lora_weights_transform_pass(lora)
    for n in masks:
        assert (fused.model.get_submodule(n).weight[~masks[n]] == 0).all(), n
    with torch.no_grad():
        assert (fused.model(**x).logits - unfused).abs().max() <= 1e-5
        assert (unfused - mg.model(**x).logits).abs().max() > 1e-3  # the adapters did change the outputs
    cfg = {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": {
        "name": "integer", "weight_width": 8, "weight_frac_width": 6}}}
    quant, info = passes.quantize_transform_pass(mg.copy(), cfg)
    for n in masks:
        q = quant.model.get_submodule(n)
        assert (q.weight_quantizer(q.weight)[~masks[n]] == 0).all(), n
