"""Shape guards: a captured graph refuses inputs it was not specialised for, clearly, even after a checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bert_inputs, make_agru, make_tiny_bert, rehash_manifest, replace_expr_check

from fxforge import ForgeGraph
from fxforge.graph.guards import GUARD_NODE, ShapeGuardError
from fxforge.graph.static_dims import input_dims, specialisation_reasons


@pytest.fixture(scope="module")
def agru() -> tuple[torch.nn.Module, ForgeGraph]:
    model = make_agru()
    return model, ForgeGraph(model, torch.randn(2, 12, 8)).eval()


def test_agru_refuses_other_lengths_naming_the_unrolled_loop(agru: tuple[torch.nn.Module, ForgeGraph],
                                                             tmp_path: Path) -> None:
    model, mg = agru
    assert mg.frontend == "export"
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "agru"))
    for graph in (mg, mg.copy(), loaded):
        x = torch.randn(3, 12, 8)  # another batch size: fine
        with torch.no_grad():
            assert (graph(x) - model(x)).abs().max() <= 1e-5
        for length in (20, 5):
            pattern = rf"input 'x' dimension 1 is {length}, .* exactly 12: .*loop over it was unrolled into 12 steps"
            with pytest.raises(ShapeGuardError, match=pattern + ".*re-capture"):
                graph(torch.randn(3, length, 8))
        with pytest.raises(ShapeGuardError, match="input 'x' has 2 dimensions"):
            graph(torch.randn(3, 12))


def test_bert_dynamic_dims_inside_the_range_equal_eager(tmp_path: Path) -> None:
    model = make_tiny_bert()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()
    assert sum(n.name == GUARD_NODE for n in mg.nodes) == 1
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "bert"))
    for graph in (mg, loaded):
        for batch, seq in ((1, 3), (4, 33), (2, 64)):
            inputs = bert_inputs(labels=False, batch=batch, seq=seq)
            with torch.no_grad():
                assert (graph(**inputs).logits - model(**inputs).logits).abs().max() <= 1e-5
        with pytest.raises(ShapeGuardError, match=r"input 'input_ids' dimension 1 is 65, .*sizes in \[2, 64\]"):
            graph(**bert_inputs(labels=False, seq=65))
        bad = bert_inputs(labels=False, seq=12)
        bad["attention_mask"] = bad["attention_mask"][:, :10]
        with pytest.raises(ShapeGuardError, match="'attention_mask' dimension 1 is 10, .*'input_ids' dimension 1"):
            graph(**bad)


def test_guard_survives_passes_that_clean_up_the_graph(agru: tuple[torch.nn.Module, ForgeGraph]) -> None:
    mg = agru[1].copy()
    mg.model.graph.eliminate_dead_code()  # the guard has no users, but a side effect
    mg.recompile()
    with pytest.raises(ShapeGuardError):
        mg(torch.randn(3, 20, 8))


# -- dimensions torch.export keeps static in a dynamic capture, with the reason ------------------------------

def make_tiny_funnel() -> torch.nn.Module:
    """A random two-block FunnelModel (pooling between blocks) small enough for unit tests. separate_cls=False:
    with the default, the checkpoint's stored-write check refuses Funnel's ``positional_attn *= cls_mask``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.FunnelConfig(d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                       num_decoder_layers=1, vocab_size=100, separate_cls=False)
    return transformers.FunnelModel(config).eval()


@pytest.fixture(scope="module")
def funnel() -> tuple[torch.nn.Module, ForgeGraph]:
    model = make_tiny_funnel()
    return model, ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"]).eval()


FUNNEL_CAUSE = r"torch.export specialised input_ids dim 1 to 16: the model's code needs its value as a Python int" \
               r".*modeling_funnel.py:\d+ in get_position_embeds `pos = list\(range\(seq_len\)\)`"


def test_funnel_capture_records_the_static_length_and_why(funnel: tuple[torch.nn.Module, ForgeGraph],
                                                          tmp_path: Path) -> None:
    model, mg = funnel
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "funnel"))
    for graph in (mg, loaded):
        dims = input_dims(graph.model)
        assert dims.guarded and [d.split(" ")[0] for d in dims.dynamic] == ["input_ids[0]", "attention_mask[0]"]
        static = {(s.input, s.dim): s for s in dims.static}
        assert set(static) == {("input_ids", 1), ("attention_mask", 1)}
        assert static["input_ids", 1].size == 16 and re.search(FUNNEL_CAUSE, static["input_ids", 1].reason)
        assert "broadcast against a dimension that is already fixed" in static["attention_mask", 1].reason
        inputs = bert_inputs(labels=False, batch=5, seq=16)  # another batch size at the static length: exact
        with torch.no_grad():
            assert torch.equal(graph(**inputs).last_hidden_state, model(**inputs).last_hidden_state)
        with pytest.raises(ShapeGuardError, match=r"'input_ids' dimension 1 is 12, .*exactly 16: " + FUNNEL_CAUSE):
            graph(**bert_inputs(labels=False, seq=12))


def test_raw_export_specialises_funnel_length_too() -> None:
    """Not fxforge's doing: torch.export itself fixes Funnel's length, and says where."""
    kwargs = bert_inputs(labels=False, batch=2, seq=8)
    shapes = {k: {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO} for k in kwargs}
    ep = torch.export.export(make_tiny_funnel(), (), kwargs, dynamic_shapes=shapes, strict=False)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in kwargs]
    assert [tuple(n.meta["val"].shape)[1] for n in placeholders] == [8, 8]
    assert re.search(FUNNEL_CAUSE.replace("16", "8"), specialisation_reasons(placeholders)["input_ids", 1])


def test_bert_keeps_every_input_dim_dynamic() -> None:
    dims = input_dims(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).model)
    assert dims.guarded and dims.static == ()
    assert dims.dynamic == ("input_ids[0]", "input_ids[1] in [2, 64]", "attention_mask[0]",
                            "attention_mask[1] (= input_ids[1])")


def test_agru_feature_dim_is_static_because_of_the_weight(agru: tuple[torch.nn.Module, ForgeGraph]) -> None:
    static = {(s.input, s.dim): s.reason for s in input_dims(agru[1].model).static}
    assert set(static) == {("x", 1), ("x", 2)}
    assert re.search(r"unrolled into 12 steps.*agru.py:\d+ in forward `for t in range\(x.size\(1\)\):`",
                     static["x", 1])
    assert re.search(r"specialised x dim 2 to 8: it meets a fixed-size operand such as a layer's weight",
                     static["x", 2])


def test_checkpoint_from_before_the_reasons_still_loads_and_reports(funnel: tuple[torch.nn.Module, ForgeGraph],
                                                                    tmp_path: Path) -> None:
    """Checkpoints written before the reasons carry the old generic text in the same field: they load, guard
    and report their static dimensions with that text."""
    path = funnel[1].export(tmp_path / "old")
    doc = json.loads((path / "graph.json").read_text())
    old = "capture specialised this dimension to the example's 16 (the model's code depends on its value)"
    text = re.sub(r"torch\.export specialised [^\"]*", old, json.dumps(doc))
    assert text.count(old) == 2
    (path / "graph.json").write_text(text)
    rehash_manifest(path)
    loaded = ForgeGraph.from_checkpoint(path)
    assert [(s.input, s.dim, s.size, s.reason) for s in input_dims(loaded.model).static] == \
        [("input_ids", 1, 16, old), ("attention_mask", 1, 16, old)]
    with pytest.raises(ShapeGuardError, match="exactly 16: capture specialised this dimension"):
        loaded(**bert_inputs(labels=False, seq=12))


class _Branches(torch.nn.Module):
    """Takes one of two paths by ``x.shape[-1] // 8 == 1``: torch.export guards that floor division."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] // 8 == 1:
            return x * 2
        return x - 1


def test_a_floor_division_guard_refuses_the_other_branch(tmp_path: Path) -> None:
    model = _Branches()
    mg = ForgeGraph(model, torch.randn(2, 12)).eval()
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "branches"))
    for graph in (mg, mg.copy(), loaded):
        for side in (8, 12, 15):  # the captured branch: side // 8 == 1
            x = torch.randn(3, side)
            assert torch.equal(graph(x), model(x))
        for side in (7, 16, 40):  # the other branch: refused, never a wrong answer
            with pytest.raises(ShapeGuardError, match=rf"input 'x' dimension 1 is {side},.*x\.shape\[1\] // 8"):
                graph(torch.randn(3, side))


def test_efficientnet_never_answers_outside_what_export_proved(tmp_path: Path) -> None:
    """torch.export guards EfficientNet's sides with floor divisions (``side // 32 == 1``...): a side it did not
    prove either runs exactly like eager or is refused, on the graph and on its reloaded checkpoint."""
    from reach.tiny_archs import build, capture_inputs

    def inputs(side: int) -> dict[str, torch.Tensor]:  # tiny_archs.inputs keeps this fixed-kind model at 32
        return {"pixel_values": torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(side))}

    model = build("efficientnet")
    mg = ForgeGraph(model, example_inputs=capture_inputs("efficientnet")).eval()
    assert not [n for n in mg.capture_notes if "shape guard" in n], mg.capture_notes
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "efficientnet"))
    for graph in (mg, loaded):
        for side in (40, 63):
            x = inputs(side)
            with torch.no_grad():
                assert torch.equal(graph(**x).logits, model(**x).logits), side
        for side in (64, 72):
            with pytest.raises(ShapeGuardError, match=rf"dimension \d is {side},.*// 32"):
                graph(**inputs(side))


class _Windows(torch.nn.Module):
    """Swin-style windows on a plain tensor: patches of 4, padded up to whole windows of 4 patches, then a branch
    on the window count, so torch.export's guards repeat ``(s // 4) + ((4 - (s // 4) % 4) % 4)`` in many
    reshapes (tests/reach/test_reach_guards.py runs tiny Swin itself, minutes to export)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1] // 4
        h = x[:, : s * 4].reshape(x.shape[0], s, 4).sum(-1)
        pad = (4 - s % 4) % 4
        h = torch.nn.functional.pad(h, (0, pad))
        h = h.reshape(-1, (s + pad) // 4, 4).sum(-1)
        if (s + pad) // 4 > 2:
            return h * 2
        return h - 1


def test_padded_window_guards_are_shared_programs_checked_every_call(tmp_path: Path) -> None:
    """The window-padding guards are kept as programs sharing their repeated sub-expressions (none pinned), so
    a capture at batch 2 and side 48 runs other batches and padded sides exactly like eager and refuses the
    sides they exclude, on the graph, its copy and its reloaded checkpoint."""
    from fxforge.graph.guard_expr import Plan, dims_in

    model = _Windows()
    mg = ForgeGraph(model, torch.randn(2, 48)).eval()
    assert not [n for n in mg.capture_notes if "shape guard" in n], mg.capture_notes
    programs = [c[3] for c in mg.node(GUARD_NODE).kwargs["checks"] if c[2] == "expr"]
    padded = [p for p in programs if sum(s[0] == "mod" for s in p[1:]) >= 2]  # ... % 4) % 4: the padding
    assert len(padded) > 5 and all(p[0] == "let" and dims_in(p) for p in padded)
    assert len(Plan(programs).steps) < sum(len(p) - 1 for p in programs) / 2  # shared across programs too
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "windows"))
    for graph in (mg, mg.copy(), loaded):
        for batch, side in ((3, 48), (7, 48), (3, 44), (1, 100), (5, 36)):  # 44: one window padded
            x = torch.randn(batch, side)
            assert torch.equal(graph(x), model(x)), (batch, side)
        for side, why in ((32, r"// 4\) > 2"), (16, r"!= 1"), (47, r"x\.shape\[1\] == \(4 \* ")):
            with pytest.raises(ShapeGuardError, match=rf"input 'x' dimension 1 is {side},.*{why}"):
                graph(torch.randn(3, side))


def test_the_compiled_guards_decide_like_the_reference_interpreter() -> None:
    """check_input_shapes (programs compiled once, shared operations evaluated once per call) accepts and
    refuses exactly the shapes graph/guard_expr.evaluate does, program by program, with the same errors."""
    from fxforge.graph.guard_expr import evaluate
    from fxforge.graph.guards import check_input_shapes

    mg = ForgeGraph(_Windows(), torch.randn(2, 48)).eval()
    kwargs = mg.node(GUARD_NODE).kwargs
    lists = tuple((*c[:3], json.loads(json.dumps(c[3])), c[4]) for c in kwargs["checks"])  # as old checkpoints
    for batch in (1, 2, 3):
        for side in range(0, 70):
            x = torch.randn(batch, side)
            try:
                expected = next((c[4] for c in kwargs["checks"] if c[2] == "expr"
                                 and not evaluate(c[3], [tuple(x.shape)])), None)
            except ValueError as exc:
                expected = str(exc)
            for checks in (kwargs["checks"], lists):
                try:
                    check_input_shapes(x, names=kwargs["names"], checks=checks)
                    got = None
                except ShapeGuardError as exc:
                    got = next(c[4] for c in kwargs["checks"] if f": {c[4]}. Pass inputs" in str(exc))
                except ValueError as exc:
                    got = str(exc)
                assert got == expected, (batch, side)


def _branches_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = ForgeGraph(_Branches(), torch.randn(2, 12)).eval().export(tmp_path / "branches")
    return path, json.loads((path / "graph.json").read_text())


@pytest.mark.parametrize("tree", [
    ["call", "__import__", ["int", 1]],  # a function by name
    ["pow", ["int", 10], ["int", 100000]],  # an op outside the grammar
    ["int", "1"],  # a non-integer leaf
    ["dim", 5, 0],  # an input that does not exist
    ["dim", 0, 9],  # a dimension the input does not have
    ["cmp", "==", ["int", 1], ["int", 2], ["int", 3]],  # malformed arity
    ["let", ["add", ["dim", 0, 1], ["int", 1]], ["cmp", "==", ["ref", 1], ["int", 9]]],  # a step reading itself
    ["let", ["cmp", "==", ["ref", 0], ["int", 9]], ["add", ["dim", 0, 1], ["int", 1]]],  # a later step
    ["let", ["add", ["dim", 0, 1], ["add", ["int", 1], ["int", 2]]]],  # a nested operand instead of a step
    ["let", ["let", ["add", ["dim", 0, 1], ["int", 1]]]],  # a program inside a program
    ["let", ["pow", ["dim", 0, 1], ["int", 2]]],  # an op outside the grammar as a step
    ["add", ["ref", 0], ["int", 1]],  # a step reference outside a program
], ids=["call", "pow", "str_leaf", "no_input", "no_dim", "arity", "self_ref", "later_ref", "nested_operand",
        "nested_let", "step_pow", "stray_ref"])
def test_hostile_guard_expressions_are_refused(tmp_path: Path, tree: list[Any]) -> None:
    """A checkpoint's guard expression is data read by a small interpreter: anything outside its grammar is
    refused when the checkpoint loads (the guard is validated once there, not on every call), never evaluated."""
    from fxforge.graph.targets import CheckpointError

    path, doc = _branches_checkpoint(tmp_path)
    text = json.dumps(doc)
    assert text.count('"expr"') == 1
    doc = json.loads(text)
    replace_expr_check(doc, tree)
    (path / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(path)
    with pytest.raises(CheckpointError, match="fxforge.check_input_shapes.*shape guard"):
        ForgeGraph.from_checkpoint(path)


@pytest.mark.parametrize("shape", ["deep", "wide"])
def test_an_oversized_guard_expression_is_refused(tmp_path: Path, shape: str) -> None:
    """A deep tree is refused by the loader's nesting limit, a wide one by the guard's node budget."""
    from fxforge.graph.targets import CheckpointError

    path, doc = _branches_checkpoint(tmp_path)
    tree: list[Any] = ["int", 1]
    if shape == "deep":
        for _ in range(40):
            tree = ["mul", tree, ["int", 10**18]]
    else:
        tree = ["max", *[["mul", ["int", 10**18], ["int", 10**18]] for _ in range(1000)]]
    replace_expr_check(doc, ["cmp", "==", tree, ["int", 1]])
    (path / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(path)
    with pytest.raises(CheckpointError, match="nested|nodes"):
        ForgeGraph.from_checkpoint(path)


@pytest.mark.parametrize("check", [
    [9, 0, "rank", 2, "an input that does not exist"],
    [0, 0, "exec", 2, "a kind outside the grammar"],
    [0, 1, "range", [5], "a range without its upper bound"],
    [0, 1, "same", [0, "1"], "another input's dimension given as text"],
    [0, 1, "eq", 12],
], ids=["no_input", "kind", "range", "same", "arity"])
def test_hostile_plain_checks_are_refused_at_load(tmp_path: Path, check: list[Any]) -> None:
    """The guard's other checks are validated at load too: the per-call check trusts its data."""
    from fxforge.graph.targets import CheckpointError

    path, doc = _branches_checkpoint(tmp_path)
    assert _replace_check(doc, check)
    (path / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(path)
    with pytest.raises(CheckpointError, match="fxforge.check_input_shapes.*shape guard check"):
        ForgeGraph.from_checkpoint(path)


def _replace_check(doc: Any, check: list[Any]) -> bool:
    """Replace the (one) ``expr`` check of a checkpoint's JSON by ``check``."""
    if isinstance(doc, dict):
        return any(_replace_check(v, check) for v in doc.values())
    if isinstance(doc, list):
        for i, v in enumerate(doc):
            items = v.get("items") if isinstance(v, dict) else v
            if isinstance(items, list) and len(items) == 5 and items[2] == "expr":
                doc[i] = check
                return True
        return any(_replace_check(v, check) for v in doc)
    return False



def test_a_guard_outside_the_grammar_fixes_the_dims_it_names() -> None:
    """A guard the checkpointable grammar cannot hold (here a power) is never dropped: the dimensions it
    reads are fixed to the example's sizes, refused loudly, and the capture notes say so."""
    from fxforge.graph.guards import check_input_shapes, guard_spec

    ep = torch.export.export(_Branches(), (torch.randn(2, 12),), dynamic_shapes=({0: torch.export.Dim.AUTO,
                                                                                  1: torch.export.Dim.AUTO},))
    gm = ep.graph_module
    names, checks, notes = guard_spec(gm, ep.range_constraints, ["L['x'].size()[1] ** 2 < 200"], True)
    assert (0, 1, "eq", 12) in [c[:4] for c in checks]
    assert any("fixes x dim 1 to the example's size" in n for n in notes)
    check_input_shapes(torch.randn(5, 12), names=names, checks=checks)
    with pytest.raises(ShapeGuardError, match=r"dimension 1 is 13, .*exactly 12: torch.export guard .*\*\* 2"):
        check_input_shapes(torch.randn(5, 13), names=names, checks=checks)
