"""buffer_reuse_transform_pass: in-place / out= rewrites proved safe by the liveness run, bit-identical outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import TinyMLP, bert_inputs, make_agru, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.passes import PassError, buffer_reuse_transform_pass, get_pass
from fxforge.passes.memory.buffer_reuse import BufferReuseInfo


def _out(value: Any) -> torch.Tensor:
    return value.logits if hasattr(value, "logits") else value


def _call(mg: Any, inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        return _out(mg(**inputs) if isinstance(inputs, dict) else mg(*inputs))


def _gpt_idx(batch: int, length: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length)),)


def _writes_into(node: Any, kind: str) -> str | None:
    """The name of the node whose buffer ``node`` writes into, in place (its first argument) or through out=."""
    if kind == "out":
        out = node.kwargs.get("out")
        return out.name if out is not None else None
    target = node.target
    in_place = (node.op == "call_method" and str(target).endswith("_")) or (
        isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable)
    return node.args[0].name if in_place else None


# name -> (model, capture kwargs, two input sets of shapes other than the capture's)
MODELS: dict[str, tuple[Any, Any, list[Any]]] = {
    "tiny_bert": (make_tiny_bert, lambda: {"hf_input_names": ["input_ids", "attention_mask"]},
                  [bert_inputs(labels=False, batch=3, seq=11), bert_inputs(labels=False, batch=1, seq=7)]),
    "gpt_attention": (make_gpt, lambda: {"example_inputs": _gpt_idx(2, 16)}, [_gpt_idx(3, 9), _gpt_idx(1, 20)]),
    "gpt_afno": (lambda: make_gpt("afno"), lambda: {"example_inputs": _gpt_idx(2, 16)},
                 [_gpt_idx(3, 9), _gpt_idx(1, 20)]),
    "agru": (make_agru, lambda: {"example_inputs": (torch.randn(2, 5, 8),)},  # captured for 5 steps
             [(torch.randn(3, 5, 8),), (torch.randn(1, 5, 8),)]),
    "agru_frozen": (make_agru, lambda: {"example_inputs": (torch.randn(2, 5, 8),)},  # parameters frozen below
                    [(torch.randn(3, 5, 8),), (torch.randn(1, 5, 8),)]),
    "tiny_mlp": (lambda: TinyMLP().eval(), lambda: {"example_inputs": (torch.randn(4, 8),)},
                 [(torch.randn(5, 8),), (torch.randn(2, 8),)]),
}
_DONE: dict[str, tuple[ForgeGraph, ForgeGraph, BufferReuseInfo]] = {}


def reused(name: str) -> tuple[ForgeGraph, ForgeGraph, BufferReuseInfo]:
    """(captured graph, rewritten graph, info) per model, built once per test session."""
    if name not in _DONE:
        build, capture, _ = MODELS[name]
        if name == "agru_frozen":  # the same capture with frozen parameters (out= needs operands without grad)
            mg = reused("agru")[0].copy()
            mg.model.requires_grad_(False)
        else:
            mg = ForgeGraph(build().eval(), **capture())
        new, info = buffer_reuse_transform_pass(mg)
        _DONE[name] = (mg, new, info)
    return _DONE[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_are_bit_identical_at_two_shapes_and_the_estimate_drops(name: str) -> None:
    mg, new, info = reused(name)
    assert info.rewrites and info.changed
    assert info.bytes_saved == sum(r.bytes_saved for r in info.rewrites) > 0
    assert info.peak_after_bytes < info.peak_before_bytes
    nodes = {n.name: n for n in new.model.graph.nodes}
    assert all(_writes_into(nodes[r.node], r.kind) == r.into for r in info.rewrites)
    assert not any(_writes_into(n, "in_place") or _writes_into(n, "out") for n in mg.model.graph.nodes)
    for inputs in MODELS[name][2]:
        before, after = _call(mg, inputs), _call(new, inputs)
        assert torch.equal(before, after), name


def test_out_buffers_are_reused_only_where_no_operand_requires_grad() -> None:
    _, _, trainable = reused("agru")
    _, _, frozen = reused("agru_frozen")
    assert not any(r.kind == "out" for r in trainable.rewrites)
    assert any("requires grad" in r.reason for r in trainable.refused)
    outs = [r for r in frozen.rewrites if r.kind == "out"]
    assert outs and all(r.op == "matmul.out" for r in outs)
    assert frozen.peak_after_bytes <= frozen.peak_before_bytes


@pytest.mark.parametrize("name", ["tiny_bert", "gpt_afno", "agru_frozen"])
def test_rewritten_graph_round_trips_through_a_checkpoint(name: str, tmp_path: Path) -> None:
    _, new, _ = reused(name)
    loaded = ForgeGraph.from_checkpoint(new.export(tmp_path / name))
    assert [n.target for n in loaded.model.graph.nodes] == [n.target for n in new.model.graph.nodes]
    for inputs in MODELS[name][2]:
        assert torch.equal(_call(loaded, inputs), _call(new, inputs))


def test_forward_in_grad_mode_with_trainable_parameters_is_identical() -> None:
    mg, new, _ = reused("tiny_bert")
    inputs = MODELS["tiny_bert"][2][0]
    assert any(p.requires_grad for p in new.model.parameters())
    with torch.enable_grad():
        assert torch.equal(_out(mg(**inputs)), _out(new(**inputs)))


class _Aliasing(nn.Module):
    """Returns its input beside relu(input), and a linear's result beside relu of it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)
        v = x.view(-1)
        return x, torch.relu(x), h, torch.relu(h), v, torch.sigmoid(v)


def test_a_buffer_an_output_aliases_is_never_overwritten() -> None:
    x = torch.randn(4, 8)
    mg = ForgeGraph(_Aliasing().eval(), (x,))
    new, info = buffer_reuse_transform_pass(mg)
    assert not info.rewrites
    reasons = {r.node: r.reason for r in info.refused}
    assert reasons["relu"] == "x: shares storage with the graph input 'x'"
    assert reasons["relu_1"] == "fc: 'fc' is returned by the graph"
    assert reasons["sigmoid"] == "view: shares storage with the graph input 'x'"
    ops = [n.target for n in new.model.graph.nodes if n.op == "call_function"]
    assert torch.relu in ops and torch.sigmoid in ops
    y = torch.randn(3, 8)
    for a, b in zip(mg(y), new(y)):
        assert torch.equal(a, b)


class _Chain(nn.Module):
    """relu's input is read again later; the sum may reuse relu's buffer; s broadcasts, t does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.one, self.wide = nn.Linear(8, 16), nn.Linear(8, 1), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = torch.relu(h)
        b = a + h
        s, t = self.one(x), self.wide(x)
        c = s * t
        d = c.half() + b  # promotes to float32: only b may be overwritten
        return d.to(torch.int32) + 1  # integer: refused


def test_later_reader_broadcast_promotion_and_integers_are_refused_by_name() -> None:
    x = torch.randn(4, 8)
    mg = ForgeGraph(_Chain().eval(), (x,))
    new, info = buffer_reuse_transform_pass(mg, {"measure": True})
    assert info.measured_before_bytes is not None and info.measured_after_bytes is not None
    assert info.measured_before_bytes > 0 and info.measured_after_bytes > 0
    reasons = {r.node: r.reason for r in info.refused}
    done = {r.node: r for r in info.rewrites}
    assert "'fc' is read later by 'add'" in reasons["relu"]
    assert done["add"].into == "relu"  # a's last reader is the sum: its buffer takes the result
    assert done["mul"].into == "wide"  # t has the result's shape
    assert "broadcast" not in reasons.get("mul", "")
    assert done["add_1"].into == "add"  # the float32 operand, not the half one
    assert "integer or bool" in reasons["add_2"]
    for y in (torch.randn(5, 8), torch.randn(2, 8)):
        assert torch.equal(mg(y), new(y))


class _Shapes(nn.Module):
    """s * t may overwrite t only (s broadcasts); u * v neither (u promotes to float32, v broadcasts)."""

    def __init__(self) -> None:
        super().__init__()
        self.one, self.wide = nn.Linear(8, 1), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = self.one(x), self.wide(x)
        u, v = self.wide(x).half(), self.one(x)
        return s * t, u * v


def test_broadcast_and_promotion_reasons_are_given_per_operand() -> None:
    mg = ForgeGraph(_Shapes().eval(), (torch.randn(4, 8),))
    _, info = buffer_reuse_transform_pass(mg, {"in_place": True, "out": False})
    done = {r.node: r for r in info.rewrites}
    assert done["mul"].into == "wide"
    reasons = {r.node: r.reason for r in info.refused}
    assert "broadcast" in reasons["mul_1"] and "dtype promotion" in reasons["mul_1"]


class _StoredInput(nn.Module):
    """relu of an embedding of a buffer: fresh at run time, but the checkpoint's check cannot prove it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.register_buffer("ids", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.emb(self.ids)) + x


def test_a_value_the_checkpoint_cannot_prove_fresh_is_refused_and_export_works(tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    mg = ForgeGraph(_StoredInput().eval(), (x,))
    new, info = buffer_reuse_transform_pass(mg)
    reasons = {r.node: r.reason for r in info.refused}
    assert "stored tensor 'ids'" in reasons["relu"]
    loaded = ForgeGraph.from_checkpoint(new.export(tmp_path / "ck"))
    assert torch.equal(loaded(x), mg(x))


def test_training_mode_is_refused_and_the_alias_resolves() -> None:
    mg = ForgeGraph(TinyMLP().train(), (torch.randn(4, 8),))
    with pytest.raises(PassError, match="buffer_reuse_transform_pass.*training mode.*eval"):
        buffer_reuse_transform_pass(mg)
    assert get_pass("buffer_reuse") is buffer_reuse_transform_pass


def test_constants_still_fold_after_buffer_reuse() -> None:
    """An in-place node's result is its written operand only: its other inputs (here the token-type embedding
    of a stored buffer, a parameter-only value) are not mutated, so folding still finds them."""
    from fxforge.passes import fold_constants_transform_pass

    mg, new, _ = reused("tiny_bert")
    _, alone = fold_constants_transform_pass(mg)
    folded, info = fold_constants_transform_pass(new)
    assert info.folded == alone.folded > 0
    inputs = MODELS["tiny_bert"][2][0]
    assert torch.equal(_call(folded, inputs), _call(mg, inputs))


def test_metadata_of_rewritten_nodes_is_derived_afresh() -> None:
    from fxforge.passes import add_common_metadata_analysis_pass, holds, init_metadata_analysis_pass

    mg = ForgeGraph(make_gpt(), example_inputs=_gpt_idx(2, 16))
    mg, _ = init_metadata_analysis_pass(mg)
    mg, _ = add_common_metadata_analysis_pass(mg)
    new, info = buffer_reuse_transform_pass(mg)
    assert info.rewrites and holds("shapes", new)
    for r in info.rewrites:
        old, now = mg.node(r.node).meta["fxforge"].common, new.node(r.node).meta["fxforge"].common
        assert now.results == old.results and now.op == old.op, r.node
