"""Equivalence sweep: every model fxforge captures, run at shapes other than the capture's.

Inside the shapes the graph accepts it equals eager (<= 1e-5); outside it raises a clear error, never a
silent answer. Export-captured graphs refuse with a ShapeGuardError naming input, dimension and range;
fx-captured graphs are the model's own Python (no specialisation), so outside the model's limits they
fail exactly where eager fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_agru, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.graph.guards import ShapeGuardError


def _tokens(batch: int, length: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length)),)


def _seq(batch: int, length: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, length, 8, generator=torch.Generator().manual_seed(batch * 100 + length)),)


def _bert(batch: int, length: int) -> dict[str, torch.Tensor]:
    return bert_inputs(vocab=100, batch=batch, seq=length, labels=False)


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[int, int], Any]
    frontend: str
    capture: tuple[int, int]
    inside: tuple[tuple[int, int], ...]
    outside: tuple[int, int]
    error: str  # the error the outside shape raises (a regex of its message)


CASES = {
    "gpt_attn_fx": Case(make_gpt, _tokens, "fx", (2, 16), ((3, 8), (4, 32)), (2, 40), "exceeds dimension size"),
    "gpt_attn_export": Case(make_gpt, _tokens, "export", (2, 16), ((3, 8), (4, 32)), (2, 40),
                            r"dimension 1 is 40, .*\[\d+, 32\]"),
    "gpt_afno_fx": Case(lambda: make_gpt("afno"), _tokens, "fx", (2, 16), ((3, 8), (4, 32)), (2, 40),
                        "index out of range"),
    "agru_export": Case(make_agru, _seq, "auto", (2, 12), ((3, 12), (5, 12)), (2, 20),
                        r"dimension 1 is 20, .*exactly 12: .*unrolled"),
    "bert_export": Case(make_tiny_bert, _bert, "auto", (2, 16), ((3, 11), (4, 40)), (2, 65),
                        r"'input_ids' dimension 1 is 65, .*\[2, 64\]"),
}


def _call(f: Any, inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        out = f(**inputs) if isinstance(inputs, dict) else f(*inputs)
    out = out.logits if hasattr(out, "logits") else out
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", sorted(CASES))
def test_inside_equals_eager_and_outside_fails_clearly(name: str) -> None:
    case = CASES[name]
    model = case.make().eval()
    example = case.inputs(*case.capture)
    mg = ForgeGraph(model, example, frontend=case.frontend).eval()  # type: ignore[arg-type]
    for shape in case.inside:
        inputs = case.inputs(*shape)
        assert (_call(mg, inputs) - _call(model, inputs)).abs().max() <= 1e-5, (name, shape)
    outside = case.inputs(*case.outside)
    expected = ShapeGuardError if mg.frontend == "export" else Exception
    with pytest.raises(expected, match=case.error):
        _call(mg, outside)
    if mg.frontend == "fx":
        with pytest.raises(Exception, match=case.error):  # eager fails the same way: no silent answer
            _call(model, outside)
