"""Capture works on a copy of the user's model: passes on the graph never change the eager model the user
keeps (e.g. as the unpruned reference), unless ``share_weights=True`` asks for shared tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.capture_cache import clear_capture_cache
from fxforge.passes.prune import prune_transform_pass
from fxforge.passes.transform.lora import insert_lora_adapter_transform_pass

PRUNE = {"weight": {"sparsity": 0.5}}
LORA = {"rank": 2, "exclude": {"name": "lm_head|classifier"}}


def _gpt() -> tuple[nn.Module, dict[str, Any]]:
    return make_gpt(), {"example_inputs": torch.randint(0, 64, (2, 16)), "frontend": "fx"}


def _bert() -> tuple[nn.Module, dict[str, Any]]:
    return make_tiny_bert(), {"hf_input_names": ["input_ids", "attention_mask"]}


def _snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, bool], dict[str, type]]:
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: p.requires_grad for k, p in model.named_parameters()},
            {k: type(m) for k, m in model.named_modules()})


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize(("build", "frontend"), [(_gpt, "fx"), (_bert, "export")])
def test_passes_on_the_graph_leave_the_users_model_unchanged(build: Any, frontend: str, cache: bool) -> None:
    clear_capture_cache()
    if cache:  # a second capture of the architecture is served by the capture cache
        first, kwargs = build()
        ForgeGraph(first, **kwargs)
    model, kwargs = build()
    state, grads, types = _snapshot(model)
    mg = ForgeGraph(model, **kwargs)
    assert mg.frontend == frontend
    assert not _storages(mg.model) & _storages(model)
    names = dict(mg.model.named_parameters())  # the graph keeps the model's own parameter names
    assert names.keys() <= dict(model.named_parameters()).keys() and len(names) > 10
    # passes run in place on the graph (what pipelines do) still never reach the model
    mg, _ = prune_transform_pass.apply_inplace(mg, PRUNE)
    mg, _ = insert_lora_adapter_transform_pass.apply_inplace(mg, LORA)
    after = _snapshot(model)
    assert after[0].keys() == state.keys() and all(torch.equal(v, after[0][k]) for k, v in state.items())
    assert after[1] == grads and after[2] == types
    assert any(not p.requires_grad for p in mg.model.parameters())  # LoRA really froze the graph's copy


@pytest.mark.parametrize(("build", "frontend"), [(_gpt, "fx"), (_bert, "export")])
def test_share_weights_shares_the_tensors_not_the_modules(build: Any, frontend: str) -> None:
    clear_capture_cache()
    model, kwargs = build()
    mg = ForgeGraph(model, share_weights=True, **kwargs)
    own = dict(model.named_parameters())
    for name, p in mg.model.named_parameters():
        assert p is own[name]  # the same tensors: pruning the graph's weights in place prunes the model's
    assert _storages(mg.model) <= _storages(model)
    assert not {id(m) for m in mg.model.modules()} & {id(m) for m in model.modules()}
    mg, _ = prune_transform_pass.apply_inplace(mg, PRUNE)
    assert any((p == 0).float().mean() > 0.4 for n, p in model.named_parameters() if n.endswith("weight"))


def test_capture_leaves_the_config_alone_and_computes_what_the_model_computes() -> None:
    model = make_tiny_bert()
    config = model.config.to_dict()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    assert model.config.to_dict() == config  # HF's forward with labels sets config.problem_type: on the copy
    inputs = bert_inputs()
    with torch.no_grad():
        assert torch.equal(mg(**inputs).logits, model(**inputs).logits)
