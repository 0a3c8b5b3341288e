"""A report's notes are about the model in it: capturing an encoder (whose forward never builds a KV cache)
notes nothing about use_cache; a decoder or an encoder-decoder keeps the note (tests/report/test_graph_view.py
checks a captured encoder's report)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import make_tiny_bert  # noqa: E402
from hf_tiny import tiny_hf  # noqa: E402


@pytest.mark.parametrize(("family", "noted"), [("bert", False), ("gpt2", True), ("llama", True), ("t5", True)])
def test_use_cache_note_only_for_models_that_build_a_cache(family: str, noted: bool) -> None:
    from fxforge.graph.hf import cache_disabled

    model = make_tiny_bert() if family == "bert" else tiny_hf(family)
    notes: list[str] = []
    with cache_disabled(model, notes):
        assert all(not getattr(m.config, "use_cache", False) for m in model.modules() if hasattr(m, "config"))
    assert any("use_cache was turned off" in n for n in notes) is noted, notes
    assert any(getattr(m.config, "use_cache", False) for m in model.modules() if hasattr(m, "config"))  # restored
