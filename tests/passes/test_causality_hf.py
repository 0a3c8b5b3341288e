"""causality_analysis_pass on captured HF decoders (GPT-2, Llama): both checks pass, no leaking node."""

from __future__ import annotations

import pytest
from hf_tiny import tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.passes.analysis.causality import describe


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_decoders_are_causal(family: str) -> None:
    mg = ForgeGraph(tiny_hf(family), hf_input_names=["input_ids"])
    passes.init_metadata_analysis_pass(mg)
    _, info = passes.causality_analysis_pass(mg)
    assert info.causal, describe(info)
    assert info.input == "input_ids" and info.first_leaking_node is None and not info.leaking_nodes
    assert info.relative_leak < 1e-5 and info.jacobian_leak is not None and info.jacobian_leak < 1e-5
