"""The injection engine swaps modules behind call_module nodes and reports what it did."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs
from fxforge import ForgeGraph
from fxforge.passes.transform.inject import NoMatchError, inject_modules


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2.0


def test_inject_replaces_selected_modules(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert).eval()
    inputs = bert_inputs(labels=False)
    before = mg(**inputs).logits
    done = inject_modules(mg.model, {"name": "classifier"}, None, lambda name, m: _Scaled(m))
    mg.recompile()
    assert [(d.name, d.old_type, d.new_type) for d in done] == [("classifier", "Linear", "_Scaled")]
    after = mg(**inputs).logits
    bias = tiny_bert.classifier.bias
    assert torch.allclose(after, 2 * (before - bias) + 2 * bias, atol=1e-6)


def test_inject_no_match_lists_candidates(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(NoMatchError, match="Linear \\(14\\)"):
        inject_modules(mg.model, {"name": "nonexistent"}, None, lambda name, m: m)
    with pytest.raises(NoMatchError):
        inject_modules(mg.model, {"type": "linear"}, None, lambda name, m: None)
