"""causality_analysis_pass: exact verdicts on the zoo's GPTs (attention, causal AFNO, the seed's pad2n AFNO)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph, passes
from fxforge.passes.analysis.causality import CausalityRecord, describe


def _graph(mixer: str, **kw: object) -> ForgeGraph:
    model = make_gpt(mixer, **kw)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    mg = ForgeGraph(model, (idx,))
    passes.init_metadata_analysis_pass(mg)
    return mg


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_causal_gpts_pass_both_checks(mixer: str) -> None:
    mg = _graph(mixer)
    _, info = passes.causality_analysis_pass(mg)
    assert info.causal, describe(info)
    assert info.relative_leak < 1e-5 and info.jacobian_leak is not None and info.jacobian_leak < 1e-5
    assert info.first_leaking_node is None and info.input == "idx"
    assert "causal: no output depends" in describe(info)


def test_pad2n_afno_is_flagged_and_the_leak_located() -> None:
    mg = _graph("afno", afno_causality="pad2n", afno_sparsity_threshold=0.0)
    _, info = passes.causality_analysis_pass(mg)
    assert not info.causal
    assert info.perturbation_leak > 1e-4 and info.jacobian_leak > 1e-3
    first = mg.node(info.first_leaking_node)
    # the leak starts inside the first block's mixer (FFT-domain mixing), not in the embeddings or attention
    assert "mixer" in str(first.meta.get("nn_module_stack", {})) or "fft" in first.name, first.name
    ops_before = [n for n in mg.model.graph.nodes][: list(mg.model.graph.nodes).index(first)]
    assert not any(n.name in info.leaking_nodes for n in ops_before)
    rec = mg.meta(first).software.get(CausalityRecord)
    assert rec is not None and rec.relative_leak > 1e-5
    assert "NOT causal" in describe(info)


def test_bad_arguments() -> None:
    mg = _graph("attn")
    with pytest.raises(Exception, match=r"positions \[30\] outside \[1, 24\)"):
        passes.causality_analysis_pass(mg, {"positions": [30]})
    with pytest.raises(Exception, match="no input 'tokens'"):
        passes.causality_analysis_pass(mg, {"input": "tokens"})


def _issue_gpt(mixer: str, seq: int, **kw: object) -> ForgeGraph:
    """The issue's GPT (n_embd 32) on a (2, seq) input: seq == n_embd makes every (B, C, T) tensor look time-first."""
    from fxforge.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, sequence_length=seq, n_layer=2, n_head=2, n_embd=32, mixer=mixer,
                          **kw)).eval()  # type: ignore[arg-type]
    idx = torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(1))
    mg, _ = passes.init_metadata_analysis_pass(ForgeGraph(model, (idx,)))
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _fft_inputs(mg: ForgeGraph) -> list[torch.fx.Node]:
    """What the causal AFNO's rfft transforms along its last axis: the tokens and the kernel, time moved last."""
    return [n.args[0] for n in mg.model.graph.nodes if n.target is torch.fft.rfft]


@pytest.mark.parametrize("seq", [32, 64])
def test_time_axis_followed_through_transposes(seq: int) -> None:
    """T == n_embd once made (B, C, T) tensors checked along C: the causal AFNO was called leaky at transpose_1."""
    mg = _issue_gpt("afno", seq)
    mg, info = passes.causality_analysis_pass(mg)
    assert info.causal, describe(info)
    assert not info.leaking_nodes and info.relative_leak < 1e-5
    moved = _fft_inputs(mg)
    assert len(moved) == 4  # two blocks, tokens and kernel each
    for node in moved:  # checked along the last axis (not the first of size T), and nothing moved there
        last = len(mg.meta(node).common.results["data_out_0"].shape) - 1
        rec = mg.meta(node).software.get(CausalityRecord)
        assert rec is not None and rec.time_axes == (last,) and rec.relative_leak < 1e-5, (node.name, rec)
    embed = mg.meta(mg.node("blocks_0_ln1")).software.get(CausalityRecord)
    assert embed is not None and embed.time_axes == (1,)


@pytest.mark.parametrize("seq", [32, 64])
def test_pad2n_afno_caught_at_any_length(seq: int) -> None:
    _, info = passes.causality_analysis_pass(_issue_gpt("afno", seq, afno_causality="pad2n"))
    assert not info.causal and info.perturbation_leak > 1e-4 and info.jacobian_leak > 1e-4, describe(info)


@pytest.mark.parametrize("seq", [32, 64])
def test_attention_gpt_causal_at_any_length(seq: int) -> None:
    mg, info = passes.causality_analysis_pass(_issue_gpt("attn", seq))
    assert info.causal and not info.leaking_nodes, describe(info)
    sdpa = [n for n in mg.model.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention]
    assert sdpa and all(mg.meta(n).software.get(CausalityRecord).time_axes == (2,) for n in sdpa)  # (B, H, T, D)


class _Scores(torch.nn.Module):
    """Single-head self-attention written out, so its (B, T, T) scores are a node of the graph."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal, self.emb = causal, torch.nn.Embedding(16, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        scores = x @ x.transpose(1, 2)
        if self.causal:
            t = idx.size(1)
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1) @ x


@pytest.mark.parametrize("causal", [True, False])
def test_square_scores_checked_on_both_time_axes(causal: bool) -> None:
    """Scores at (query < t, key < t) are the past; a softmax over every key is the leak, found where it starts."""
    torch.manual_seed(0)
    idx = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    mg, _ = passes.init_metadata_analysis_pass(ForgeGraph(_Scores(causal).eval(), (idx,)))
    mg, info = passes.causality_analysis_pass(mg)
    rec = mg.meta(mg.node("matmul")).software.get(CausalityRecord)
    assert rec is not None and rec.time_axes == (1, 2) and rec.leak == 0.0
    assert info.causal is causal, describe(info)
    assert info.first_leaking_node == (None if causal else "softmax")


def test_int8_lowered_graph_followed_through_its_linear_kernels() -> None:
    """The lowered int8 kernel has no fake implementation: a linear layer maps only the last axis, so the time
    axis still reaches every node after it (and the pad2n leak is still found)."""
    from pass_cases import INT8_LINEAR

    for causality, causal in (("causal", True), ("pad2n", False)):
        mg = _issue_gpt("afno", 32, afno_causality=causality)
        mg, _ = passes.quantize_transform_pass(mg, INT8_LINEAR)
        mg, _ = passes.calibrate_transform_pass(mg, {"data": [mg.example_inputs.args[0]]})
        mg, _ = passes.lower_int8_transform_pass(mg)
        mg, info = passes.causality_analysis_pass(mg, {"jacobian": False})
        assert info.causal is causal, describe(info)
        rec = mg.meta(mg.node("lm_head")).software.get(CausalityRecord)
        assert rec is not None and rec.time_axes == (1,)


def test_time_axes_of_a_length_one_axis_refused_by_name() -> None:
    """The shape environment keeps a size-1 axis constant, so there is no time symbol to follow: a
    TimeAxisError naming the input, not an AttributeError from inside the symbolic run."""
    from fxforge.passes.analysis.time_axes import TimeAxisError, time_axes

    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    with pytest.raises(TimeAxisError, match="axis 1 of 'x' has length 1"):
        time_axes(gm, [torch.randn(2, 1, 4)], 0, 1, "x")
    axes = time_axes(gm, [torch.randn(2, 5, 4)], 0, 1, "x")
    assert axes[next(iter(gm.graph.nodes))] == (1,)
