"""Capture checks its train-mode trace against eager in eval mode (issue 27): behaviour other than dropout that
depends on ``training`` but is invisible to the random-op detector (random choices made with numpy, outputs that
depend on ``self.training``) is captured in eval semantics with train mode refused, never baked in silently.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from reach.tiny_archs import build, capture_inputs, check_inputs, inputs

from fxforge import ForgeGraph
from fxforge.graph.training_guard import GUARD_MODULE, TrainingOnlyError


def _guards(mg: ForgeGraph) -> list[torch.fx.Node]:
    return [n for n in mg.nodes if n.op == "call_module" and n.target == GUARD_MODULE]


def _assert_equal(got: Any, want: Any, what: str) -> None:
    """Same output keys; every tensor equal in shape, dtype and bits."""
    assert list(got.keys()) == list(want.keys()), what
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key}"
        elif isinstance(value, list | tuple):
            assert len(got[key]) == len(value), f"{what}: {key}"
            for a, b in zip(got[key], value):
                assert torch.equal(a, b), f"{what}: {key}"


def _train_refused(mg: ForgeGraph, x: dict[str, torch.Tensor]) -> None:
    mg.train()
    with pytest.raises(TrainingOnlyError):
        mg(**x)
    mg.eval()


@pytest.mark.slow  # a BigBird capture, ~35 s: make test-slow (CI)
def test_big_bird_eval_graph_equals_eager_and_train_is_refused() -> None:
    model = build("big_bird")
    mg = ForgeGraph(model, example_inputs=capture_inputs("big_bird")).eval()
    assert len(_guards(mg)) == 1
    assert any("differs from eager in eval mode" in n for n in mg.capture_notes)
    shapes = [inputs("big_bird", 3, 16, seed=2), inputs("big_bird", 1, 16, seed=3)]  # its graph is static at 16 tokens
    for x in shapes:
        with torch.no_grad():
            _assert_equal(mg(**x), model(**x), f"big_bird at {tuple(x['input_ids'].shape)}")
    _train_refused(mg, shapes[0])


def test_xlnet_eval_outputs_include_mems_like_eager() -> None:
    model = build("xlnet")
    mg = ForgeGraph(model, example_inputs=capture_inputs("xlnet")).eval()
    assert any("outputs mems missing" in n for n in mg.capture_notes)
    for x in check_inputs("xlnet"):
        with torch.no_grad():
            want = model(**x)
            assert "mems" in want
            _assert_equal(mg(**x), want, f"xlnet at {tuple(x['input_ids'].shape)}")
    _train_refused(mg, check_inputs("xlnet")[0])


class _NumpyNoiseInTraining(nn.Module):
    """Adds numpy noise only in train mode: a graph constant in a train-mode trace, no random op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x))
        if self.training:
            y = y + torch.from_numpy(np.random.rand(4).astype(np.float32))
        return y


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_numpy_randomness_in_training_is_captured_in_eval_semantics(frontend: str) -> None:
    torch.manual_seed(0)
    model = _NumpyNoiseInTraining().eval()
    x = torch.randn(3, 4)
    mg = ForgeGraph(model, example_inputs=(x,), frontend=frontend).eval()
    assert len(_guards(mg)) == 1
    with torch.no_grad():
        for inp in (x, torch.randn(5, 4)):
            assert torch.equal(mg(inp), model(inp))
    mg.train()
    with pytest.raises(TrainingOnlyError):
        mg(x)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).relu()


def test_no_training_dependence_one_trace_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxforge.graph.capture as capture_module

    traces: list[str] = []
    real = capture_module._trace_normalized
    monkeypatch.setattr(capture_module, "_trace_normalized", lambda *a: traces.append(a[1]) or real(*a))
    torch.manual_seed(0)
    mg = ForgeGraph(_Plain().eval(), example_inputs=(torch.randn(2, 4),), frontend="export", cache=False)
    assert traces == ["export"] and not _guards(mg)
    assert not any("eager" in n for n in mg.capture_notes)


@pytest.mark.slow  # a BigBird capture, ~35 s: make test-slow (CI)
def test_capture_leaves_torch_and_numpy_random_streams_unchanged() -> None:
    model = build("big_bird")
    torch.manual_seed(123)
    np.random.seed(123)
    torch_state, np_state = torch.random.get_rng_state(), np.random.get_state()
    ForgeGraph(model, example_inputs=capture_inputs("big_bird"), cache=False)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]
