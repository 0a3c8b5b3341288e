"""Grad-mode regions in a forward (``torch.no_grad()``, ``torch.enable_grad()``, nested, a ``@torch.no_grad()``
submodule) are captured so the graph's gradients equal eager's: export inlines them into plain, checkpointable
nodes with no-grad outputs detached; fx, which cannot see them, refuses instead of dropping them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.graph.capture import CaptureError


class _NoGradProj(nn.Module):
    """A submodule whose whole forward runs without grad (the old HF rotary-embedding pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).cos()


class GradRegions(nn.Module):
    """Nested no_grad / enable_grad regions whose outputs feed the ops after them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.s = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.rot = _NoGradProj()
        self.d = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            g = self.b(h).tanh()  # no gradient reaches b, nor a through this path
            with torch.enable_grad():
                e = self.c(h) * 2  # grad re-enabled inside the no_grad region: c and a train through it
                with torch.no_grad():
                    s = self.s(e).sigmoid()  # innermost no_grad: s never trains
            k = g + s
        return self.d(h * k + e + self.rot(h))


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Gradients of every parameter and of the input after one backward of a fixed function of the output."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["<input>"] = x.grad
    return grads


def _assert_same_grads(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g is None) == (w is None), (name, g is None, w is None)
        if w is not None:
            assert torch.allclose(g, w, atol=1e-6), (name, (g - w).abs().max())  # type: ignore[operator]


@pytest.fixture
def model() -> GradRegions:
    torch.manual_seed(0)
    return GradRegions()


def test_eager_reference_has_frozen_and_training_paths(model: GradRegions) -> None:
    """The module really mixes regions: b, s and rot get no gradient, c (enable_grad inside no_grad) gets one."""
    grads = _grads(model, torch.randn(3, 6))
    assert grads["b.weight"] is None and grads["s.weight"] is None and grads["rot.proj.weight"] is None
    assert grads["c.weight"] is not None and grads["c.weight"].abs().sum() > 0
    assert grads["a.weight"] is not None and grads["<input>"] is not None


def test_export_inlines_regions_and_gradients_equal_eager(model: GradRegions, tmp_path: Path) -> None:
    mg = ForgeGraph(model, example_inputs=(torch.randn(3, 6),), frontend="export")
    assert not any(isinstance(m, torch.fx.GraphModule) for m in mg.model.children())  # no region submodules
    assert not any(n.op == "call_function" and "wrap_with" in str(n.target) for n in mg.nodes)
    assert any(note.startswith("no_grad regions inlined") for note in mg.capture_notes)
    reference = GradRegions()
    reference.load_state_dict(model.state_dict())
    for batch in (3, 5):  # the captured shape and another one
        x = torch.randn(batch, 6)
        assert torch.allclose(mg(x), reference(x), atol=1e-6)
        _assert_same_grads(_grads(mg.model, x), _grads(reference, x))
    mg.export(tmp_path / "ckpt")  # inlined regions are plain nodes a checkpoint can name
    back = ForgeGraph.from_checkpoint(tmp_path / "ckpt")
    x = torch.randn(4, 6)
    _assert_same_grads(_grads(back.model, x), _grads(reference, x))


def test_capture_under_the_callers_no_grad_keeps_the_regions(model: GradRegions) -> None:
    """Capturing inside ``with torch.no_grad():`` (usual for an eval model) must not turn the regions into plain
    code: traced in the caller's no-grad mode, export saw no switch and the graph trained b, s and rot."""
    with torch.no_grad():
        mg = ForgeGraph(model, example_inputs=(torch.randn(3, 6),), frontend="export", cache=False)
    reference = GradRegions()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 6)
    _assert_same_grads(_grads(mg.model, x), _grads(reference, x))


def test_fx_refuses_grad_regions_it_cannot_keep(model: GradRegions) -> None:
    """fx traces through ``with torch.no_grad()`` without recording it: the graph would train b and s."""
    with pytest.raises(CaptureError, match=r"(?s)grad mode.*frontend='export'"):
        ForgeGraph(model, frontend="fx")


def test_auto_falls_back_to_export_and_keeps_eager_gradients(model: GradRegions) -> None:
    mg = ForgeGraph(model, example_inputs=(torch.randn(3, 6),))
    assert mg.frontend == "export"
    assert any("fell back to export" in note and "grad mode" in note for note in mg.capture_notes)
    reference = GradRegions()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 6)
    _assert_same_grads(_grads(mg.model, x), _grads(reference, x))


def test_fx_still_captures_a_forward_without_grad_regions() -> None:
    """The refusal is about grad-mode switches only: a plain forward, traced under an outer no_grad, is fx."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        mg = ForgeGraph(model, frontend="fx")
    x = torch.randn(3, 6)
    assert mg.frontend == "fx"
    _assert_same_grads(_grads(mg.model, x), _grads(model, x))
