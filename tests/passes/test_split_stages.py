"""split_stages_transform_pass: N stages whose chain equals the unsplit graph, balanced by the analyses' costs,
passing only the tensors that cross each cut; impossible or unwanted cuts refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.analysis.profile import ProfileRecord
from fxforge.passes.transform.split_stages import stage_modules


def _analysed(mg: ForgeGraph, runs: int = 3) -> ForgeGraph:
    """Metadata, liveness and (``runs`` > 0) the profile: what the three balances read."""
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    if runs:
        mg, _ = passes.profile_analysis_pass(mg, {"runs": runs})
    mg, _ = passes.liveness_analysis_pass(mg)
    return mg


@pytest.fixture(scope="module")
def gpt() -> ForgeGraph:
    torch.manual_seed(0)
    return _analysed(ForgeGraph(make_gpt(), torch.randint(0, 64, (2, 16))))


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    torch.manual_seed(0)
    return _analysed(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval(), runs=0)


def _stage_io(mg: ForgeGraph) -> list[tuple[list[str], int]]:
    """Each stage's placeholder names and how many values it returns."""
    out = []
    for stage in stage_modules(mg):
        names = [n.name for n in stage._graph.nodes if n.op == "placeholder"][:stage.inputs - len(stage.reads)]
        result = next(n for n in stage._graph.nodes if n.op == "output").args[0]
        out.append((names, len(result)))
    return out


@pytest.mark.parametrize("stages,balance", [(2, "params"), (4, "time")])
def test_split_gpt_equals_unsplit_at_two_shapes(gpt: ForgeGraph, stages: int, balance: str) -> None:
    split, info = passes.split_stages_transform_pass(gpt, {"stages": stages, "balance": balance})
    assert len(stage_modules(split)) == stages and len(info.shares) == stages
    assert not stage_modules(gpt)  # the input graph is unchanged
    for shape in ((2, 16), (3, 9)):
        idx = torch.randint(0, 64, shape)
        with torch.no_grad():
            assert torch.equal(split(idx), gpt(idx))


def test_split_gpt_sends_only_crossing_tensors(gpt: ForgeGraph) -> None:
    split, info = passes.split_stages_transform_pass(gpt, {"stages": 3, "balance": "memory"})
    io = _stage_io(split)
    for k, names in enumerate(info.sent):  # stage k + 1 receives exactly what crosses cut k, stage k returns that
        assert io[k + 1][0] == list(names) and io[k][1] == len(names) and info.sent_bytes[k] > 0
    assert io[0][0] == ["idx"] and io[-1][1] == 1  # the graph's input in, its one output out
    params = {name.replace(".", "_") for name, _ in gpt.model.named_parameters()}
    assert all(not set(names) & params and "size" not in names for names in info.sent)  # sizes are recomputed


@pytest.mark.slow  # make test covers tiny BERT split through tests/passes/test_compose (its base graph)
def test_split_bert_equals_unsplit_and_sends_only_crossing_tensors(bert: ForgeGraph, tmp_path: Path) -> None:
    split, info = passes.split_stages_transform_pass(bert, {"stages": 3, "balance": "memory"})
    for batch, seq in ((3, 11), (1, 7)):
        inputs = bert_inputs(batch=batch, seq=seq, labels=False)
        with torch.no_grad():
            assert torch.equal(split(**inputs).logits, bert(**inputs).logits)
    io = _stage_io(split)
    # stage k + 1 receives exactly what crosses cut k, and stage k returns exactly that
    for k, names in enumerate(info.sent):
        assert io[k + 1][0] == list(names) and io[k][1] == len(names)
        assert info.sent_bytes[k] > 0
    # only values made before a cut and used after it cross: the sdpa mask is, no parameter or constant is
    params = {name.replace(".", "_") for name, _ in bert.model.named_parameters()}
    assert all(not set(names) & params for names in info.sent)
    for stages in (2, 4):
        for balance in ("params", "memory"):
            _, info = passes.split_stages_transform_pass(bert, {"stages": stages, "balance": balance})
            assert info.worst_over_ideal <= 1.15, (balance, info.shares)
    loaded = ForgeGraph.from_checkpoint(split.export(tmp_path / "bert"))
    inputs = bert_inputs(batch=2, seq=9, labels=False)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, bert(**inputs).logits)


def _total_param_bytes(mg: ForgeGraph) -> int:
    return sum(p.numel() * p.element_size() for p in mg.model.parameters())


@pytest.mark.parametrize("stages", [2, 4])
def test_balance_report_within_15_percent(gpt: ForgeGraph, stages: int) -> None:
    for mg, balance in ((gpt, "params"), (gpt, "memory")):
        split, info = passes.split_stages_transform_pass(mg, {"stages": stages, "balance": balance})
        assert info.stages == stages and len(info.cuts) == stages - 1 and info.balance == balance
        assert sum(info.shares) == pytest.approx(1.0)
        assert info.worst_over_ideal == pytest.approx(max(info.shares) * stages)
        assert info.worst_over_ideal <= 1.15, (balance, info.shares)
        assert sum(info.stage_param_bytes) == _total_param_bytes(mg)  # each parameter in exactly one stage
    # with params balanced, the reported shares are the stages' own parameter bytes
    split, info = passes.split_stages_transform_pass(gpt, {"stages": stages, "balance": "params"})
    total = _total_param_bytes(gpt)
    assert [round(b / total, 9) for b in info.stage_param_bytes] == [round(s, 9) for s in info.shares]


def test_time_balance_is_the_best_cut_of_the_profile(gpt: ForgeGraph) -> None:
    """Latencies measured on a shared machine are noisy, so the 15% target for "time" is checked in the slow test
    (tests on a quiet machine); here: the chosen cut is the best single cut for the profile's own latencies."""
    ops = [n for n in gpt.nodes if n.op not in ("placeholder", "get_attr", "output")]
    costs = [gpt.meta(n).software.get(ProfileRecord).latency_ms for n in ops]
    _, info = passes.split_stages_transform_pass(gpt, {"stages": 2})
    total = sum(costs)
    position = [n.name for n in ops].index(info.cuts[0]) + 1
    assert info.shares[0] == pytest.approx(sum(costs[:position]) / total)
    # no candidate cut (any place where only tensors cross: the pass reports how many) does better; a brute force
    # over all positions is a lower bound, since candidates are a subset
    best = min(max(sum(costs[:p]), total - sum(costs[:p])) for p in range(1, len(ops))) / total
    assert best <= max(info.shares) + 1e-12
    assert info.candidates > 10


def test_split_graph_survives_a_checkpoint(gpt: ForgeGraph, tmp_path: Path) -> None:
    split, _ = passes.split_stages_transform_pass(gpt, {"stages": 3, "balance": "params"})
    loaded = ForgeGraph.from_checkpoint(split.export(tmp_path / "gpt"))
    assert len(stage_modules(loaded)) == 3
    idx = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(idx), gpt(idx))


def test_requested_cuts_are_used(gpt: ForgeGraph) -> None:
    split, info = passes.split_stages_transform_pass(gpt, {"stages": 3, "cuts": ["blocks.0", "add_6"],
                                                           "balance": "params"})
    assert info.cuts == ("add_3", "add_6")  # a module path cuts after its last op (the block's residual add)
    assert info.sent == (("add_3",), ("add_6",))
    idx = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(split(idx), gpt(idx))


@pytest.mark.parametrize("args,error,words", [
    ({"stages": 500}, PassError, ["split_stages_transform_pass", "500 stages", "at most"]),
    ({"stages": 2, "cuts": ["blocks.0.mixer.c_attn.weight"]}, PassArgsError, ["inside op", "blocks_0_mixer_c_attn"]),
    ({"stages": 2, "cuts": ["split"]}, PassArgsError, ["would split op 'split'", "getitem"]),
    ({"stages": 2, "cuts": ["blocks_0_ln2"], "pinned": ["blocks.0"]}, PassArgsError, ["pinned module 'blocks.0'"]),
    ({"stages": 5, "pinned": ["blocks"], "balance": "params"}, PassError, ["outside the pinned modules"]),
    ({"stages": 2, "cuts": ["nothing_here"]}, PassArgsError, ["names no op"]),
    ({"stages": 3, "cuts": ["add_3"]}, PassArgsError, ["give stages - 1 cuts"]),
])
def test_refusals_name_the_pass_and_the_reason(gpt: ForgeGraph, args: dict[str, Any], error: type[Exception],
                                               words: list[str]) -> None:
    with pytest.raises(error) as caught:
        passes.split_stages_transform_pass(gpt, args)
    assert "split_stages_transform_pass" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_time_balance_needs_the_profile() -> None:
    mg = ForgeGraph(make_gpt(), torch.randint(0, 64, (2, 8)))
    mg, _ = passes.init_metadata_analysis_pass(mg)
    with pytest.raises(PassError, match="run profile_analysis_pass on this graph first"):
        passes.split_stages_transform_pass(mg, {"stages": 2})
    split, info = passes.split_stages_transform_pass(mg, {"stages": 2, "balance": "params"})
    assert info.worst_over_ideal <= 1.15


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_minilm_and_deeper_gpt_time_balance(minilm_classifier: Any, stages: int) -> None:
    """The issue's targets: MiniLM-L6 and a 4-layer GPT at N = 2 and 4, worst stage within 15% of 1/N."""
    graphs = [_analysed(ForgeGraph(minilm_classifier, hf_input_names=["input_ids", "attention_mask"]).eval(), 20),
              _analysed(ForgeGraph(make_gpt(n_layer=4, n_embd=64), torch.randint(0, 64, (2, 32))), 20)]
    inputs = [bert_inputs(vocab=1000, batch=3, seq=11, labels=False), {"idx": torch.randint(0, 64, (3, 20))}]
    for mg, kwargs in zip(graphs, inputs):
        split, info = passes.split_stages_transform_pass(mg, {"stages": stages, "balance": "time"})
        print(f"N={stages}", info.shares, info.worst_over_ideal, info.sent_bytes)
        assert info.worst_over_ideal <= 1.15
        with torch.no_grad():
            a, b = split(**kwargs), mg(**kwargs)
        assert torch.equal(getattr(a, "logits", a), getattr(b, "logits", b))
