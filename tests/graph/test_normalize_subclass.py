"""A subclass of a checkpointable torch.nn module that changes nothing but its constructor (transformers'
EfficientNetDepthwiseConv2d) is held in the graph as its torch.nn base class, so its checkpoint exports and reloads
exactly; a subclass that changes behaviour (a forward, a method, a property, a class attribute, a mixin in its
method order) keeps its class and stays refused by the allowlist. The model passed in is never retyped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from reach.tiny_archs import build, capture_inputs

from fxforge import ForgeGraph
from fxforge.graph.targets import CheckpointError


def test_efficientnet_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    from transformers.models.efficientnet.modeling_efficientnet import EfficientNetDepthwiseConv2d

    model = build("efficientnet")
    depthwise = [n for n, m in model.named_modules() if isinstance(m, EfficientNetDepthwiseConv2d)]
    assert depthwise
    mg = ForgeGraph(model, example_inputs=capture_inputs("efficientnet"))
    modules = dict(mg.model.named_modules())
    assert all(type(modules[p]) is nn.Conv2d for p in depthwise)
    assert any("EfficientNetDepthwiseConv2d" in note and "torch.nn.Conv2d" in note for note in mg.capture_notes)
    back = ForgeGraph.from_checkpoint(mg.eval().export(tmp_path / "efficientnet")).eval()
    for batch, side in ((3, 40), (1, 56)):  # the capture (side 32) is valid for sides 32 to 63
        x = torch.randn(batch, 3, side, side)
        with torch.no_grad():
            got, want = back(pixel_values=x).logits, model(pixel_values=x).logits
        assert got.shape == (batch, 3)
        assert torch.equal(got, want), (batch, side)
    assert all(type(model.get_submodule(p)) is EfficientNetDepthwiseConv2d for p in depthwise)


class InitOnly(nn.Conv2d):
    """Only its constructor differs (as EfficientNetDepthwiseConv2d): calling it is exactly nn.Conv2d."""

    note: str

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.note = "depthwise"


class OwnForward(InitOnly):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class OwnConvForward(InitOnly):
    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super()._conv_forward(x, weight, bias)  # computes the same, yet is code the base does not have


class OwnMethod(InitOnly):
    def extra_repr(self) -> str:
        return "changed"


class OwnProperty(InitOnly):
    @property
    def doubled(self) -> int:
        return 2 * self.in_channels


class OwnConstants(InitOnly):
    __constants__ = ["note"]


class _Mixin(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs) + 1


class WithMixin(InitOnly, _Mixin):
    def __init__(self, channels: int) -> None:
        super().__init__(channels)


class BetweenInitOnly(InitOnly):
    """Two constructor-only classes above nn.Conv2d."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)


class Net(nn.Module):
    def __init__(self, conv: type[nn.Conv2d]) -> None:
        super().__init__()
        self.conv = conv(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def _capture(conv: type[nn.Conv2d], frontend: str, **kw: Any) -> tuple[Net, ForgeGraph]:
    """Net(conv) captured; fx traces through modules outside torch.nn unless told they are leaves."""
    torch.manual_seed(0)
    model = Net(conv).eval()
    leaves = [conv] if frontend == "fx" else []
    return model, ForgeGraph(model, example_inputs=(torch.randn(2, 4, 8, 8),), frontend=frontend,  # type: ignore[arg-type]
                             leaf_modules=leaves, **kw)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("conv", [InitOnly, BetweenInitOnly])
def test_a_constructor_only_subclass_is_held_as_its_base(tmp_path: Path, frontend: str,
                                                         conv: type[nn.Conv2d]) -> None:
    model, mg = _capture(conv, frontend)
    held = mg.model.get_submodule("conv")
    assert type(held) is nn.Conv2d and type(model.conv) is conv
    assert held.note == "depthwise" and held.groups == 4  # the instance's state, as it was built
    assert held.weight is not model.conv.weight  # the graph's own copy (share_weights=False)
    assert any(f"'conv' ({conv.__module__}.{conv.__qualname__})" in note for note in mg.capture_notes)
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt"))
    for x in (torch.randn(3, 4, 8, 8), torch.randn(1, 4, 5, 7)):
        with torch.no_grad():
            assert torch.equal(back(x), model(x))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_shared_weights_stay_shared_and_the_model_keeps_its_modules(frontend: str) -> None:
    model, mg = _capture(InitOnly, frontend, share_weights=True)
    held = mg.model.get_submodule("conv")
    assert type(held) is nn.Conv2d and held is not model.conv and type(model.conv) is InitOnly
    assert held.weight is model.conv.weight  # the same tensor: training the graph trains the model
    assert held._parameters is not model.conv._parameters and held._modules is not model.conv._modules
    held.register_buffer("extra", torch.zeros(1))
    assert "extra" not in model.conv._buffers


@pytest.mark.parametrize("conv", [OwnConvForward, OwnMethod, OwnProperty, OwnConstants, WithMixin])
def test_a_subclass_that_changes_behaviour_keeps_its_class(tmp_path: Path, conv: type[nn.Conv2d]) -> None:
    """Lifted by the export frontend (none overrides forward) yet never retyped: export refuses its class."""
    model, mg = _capture(conv, "export")
    assert type(mg.model.get_submodule("conv")) is conv
    with pytest.raises(CheckpointError, match=rf"module 'conv': module class .*{conv.__qualname__} is not in "
                                              "the checkpoint allowlist"):
        mg.export(tmp_path / "ckpt")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_subclass_with_its_own_forward_is_not_retyped(tmp_path: Path, frontend: str) -> None:
    """fx keeps the leaf as a call_module of its own class (refused by the allowlist); export keeps its ATen ops."""
    model, mg = _capture(OwnForward, frontend)
    if frontend == "fx":
        assert type(mg.model.get_submodule("conv")) is OwnForward
        with pytest.raises(CheckpointError, match=r"OwnForward is not in the checkpoint allowlist"):
            mg.export(tmp_path / "ckpt")
    else:
        assert not any(type(m) is nn.Conv2d for m in mg.model.modules())
        back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt"))
        x = torch.randn(1, 4, 6, 6)
        with torch.no_grad():
            assert torch.equal(back(x), model(x))
    assert type(model.conv) is OwnForward


def test_a_capture_cache_hit_holds_the_new_models_module_as_its_base() -> None:
    from fxforge.graph.capture import CACHE_HIT_NOTE
    from fxforge.graph.capture_cache import clear_capture_cache

    clear_capture_cache()
    first, _ = _capture(InitOnly, "export")
    torch.manual_seed(1)
    second = Net(InitOnly).eval()
    mg = ForgeGraph(second, example_inputs=(torch.randn(2, 4, 8, 8),), frontend="export", share_weights=True)
    assert CACHE_HIT_NOTE in mg.capture_notes
    held = mg.model.get_submodule("conv")
    assert type(held) is nn.Conv2d and type(second.conv) is InitOnly and held.weight is second.conv.weight
    x = torch.randn(1, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(mg(x), second(x)) and not torch.equal(mg(x), first(x))
