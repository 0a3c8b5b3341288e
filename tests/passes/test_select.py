"""The selector language: type / name / regex / predicate, same meaning on every model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.passes.select import Selector, SelectorError, matches_by, select_nodes


def _names(mg: ForgeGraph, targets: object, exclude: object = None) -> list[str]:
    return [name for _, name, _, _ in select_nodes(mg.model, targets, exclude)]


def test_type_name_regex_on_bert(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    linears = _names(mg, {"type": "linear"})
    assert linears == _names(mg, nn.Linear) == _names(mg, {"type": ["Linear"]})
    assert set(linears) == {n for n, m in tiny_bert.named_modules() if isinstance(m, nn.Linear)}
    qkv = _names(mg, {"name": ["query", "key", "value"]})
    assert len(qkv) == 6 and all(n.rsplit(".", 1)[1] in ("query", "key", "value") for n in qkv)
    assert _names(mg, {"regex": r".*layer\.1\.attention\.self\.(query|value)"}) == [
        "bert.encoder.layer.1.attention.self.query", "bert.encoder.layer.1.attention.self.value"]
    no_head = _names(mg, {"type": "linear"}, exclude={"name": ["classifier", "pooler.dense"]})
    assert len(no_head) == len(linears) - 2
    assert _names(mg, lambda name, module, op: op == "gelu")  # function nodes are selectable too


def test_same_selector_same_meaning_on_gpt() -> None:
    model = make_gpt("attn")
    mg = ForgeGraph(model, example_inputs=torch.randint(0, 64, (1, 4)))
    assert set(_names(mg, {"type": "linear"})) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert _names(mg, {"name": "lm_head"}) == ["lm_head"]


def test_selector_errors_and_by() -> None:
    with pytest.raises(SelectorError, match="allowed"):
        Selector.parse({"types": "linear"})
    with pytest.raises(SelectorError, match="regex"):
        Selector.parse({"regex": "("})
    with pytest.raises(SelectorError):
        Selector.parse(42)
    assert Selector.parse(None).empty
    assert matches_by("type", "linear", "a.b", nn.Linear(2, 2), "linear")
    assert matches_by("name", "b", "a.b", None, "add") and not matches_by("name", "a", "a.b", None, "add")
    with pytest.raises(SelectorError, match="'by'"):
        matches_by("kind", "x", "a", None, "add")
