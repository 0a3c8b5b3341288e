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
    with pytest.raises(SelectorError, match="unknown op name 'Linaer'.*'Linear'"):
        Selector.parse({"type": ["Linaer"]})  # a typo selects nothing silently no more
    assert Selector.parse({"type": ["Linear", "layer_norm", "Dropout"]}).types == ("Linear", "layer_norm", "Dropout")
    assert Selector.parse(None).empty
    assert matches_by("type", "linear", "a.b", nn.Linear(2, 2), "linear")
    assert matches_by("name", "b", "a.b", None, "add") and not matches_by("name", "a", "a.b", None, "add")
    with pytest.raises(SelectorError, match="'by'"):
        matches_by("kind", "x", "a", None, "add")


# -- one meaning of "empty", parsed once, in every pass with selector fields ------------------------------
_REQUIRED = {"prune_transform_pass": {"weight": {"sparsity": 0.5}}}  # other args a pass cannot be built without


def _selector_passes() -> list[str]:
    import dataclasses

    from fxforge.passes.base import PASSES

    return sorted(n for n, fn in PASSES.items() if dataclasses.is_dataclass(fn.spec.args_type)
                  and "targets" in {f.name for f in dataclasses.fields(fn.spec.args_type)})


def test_the_passes_with_selector_fields_are_known() -> None:
    assert set(_selector_passes()) >= {"insert_lora_adapter_transform_pass", "fuse_lora_weights_transform_pass",
                                       "fuse_kernels_transform_pass", "mask_free_activations_transform_pass",
                                       "prune_transform_pass", "freeze_transform_pass", "unfreeze_transform_pass"}


@pytest.mark.parametrize("name", _selector_passes())
@pytest.mark.parametrize("empty", [{}, [], {"name": []}, {"type": [], "regex": []}])
def test_empty_targets_is_refused_alike_by_every_pass(bert_graph: ForgeGraph, name: str, empty: object) -> None:
    from fxforge.passes import PassArgsError
    from fxforge.passes.base import PASSES

    mg = bert_graph.copy()
    with pytest.raises(PassArgsError, match=rf"{name}: 'targets' = .* is empty: an empty selector selects nothing"):
        PASSES[name](mg, {**_REQUIRED.get(name, {}), "targets": empty})
    assert not mg.history  # refused before anything ran


@pytest.mark.parametrize("name", _selector_passes())
def test_selector_fields_are_parsed_once_into_selectors(name: str) -> None:
    from fxforge.passes.base import PASSES, build_args

    args = build_args(name, PASSES[name].spec.args_type, {**_REQUIRED.get(name, {}), "targets": {"name": "query"},
                                                          "exclude": None})
    assert args.targets == Selector(names=("query",))
    assert isinstance(args.exclude, Selector) and args.exclude.empty  # an omitted exclude excludes nothing


def test_fuse_kernels_parses_its_selectors_once_not_per_node(bert_graph: ForgeGraph,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from fxforge import passes

    parsed: list[object] = []
    original = Selector.parse.__func__  # type: ignore[attr-defined]

    def counting(cls: type[Selector], spec: object) -> Selector:
        if not isinstance(spec, Selector):
            parsed.append(spec)
        return original(cls, spec)

    mg, _ = passes.add_common_metadata_analysis_pass(bert_graph.copy())
    monkeypatch.setattr(Selector, "parse", classmethod(counting))
    _, info = passes.fuse_kernels_transform_pass(mg, {"targets": {"type": "layer_norm"}, "exclude": {"name": "x"}})
    assert info.fused and parsed.count({"type": "layer_norm"}) == parsed.count({"name": "x"}) == 1  # once each
