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
