"""conv_bn_fusion_transform_pass on tiny ResNet- and MobileNet-style networks (torchvision is not installed: the
blocks are built here) and HuggingFace's ResNet: eval outputs within 1e-5 at two shapes, no BatchNorm left."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from hf_tiny import tiny_hf

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes import PassError
from fxforge.passes.transform.conv_bn_fusion import conv_bn_fusion_transform_pass


def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: type[nn.Module] | None = nn.ReLU
            ) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act is not None else []))


class BasicBlock(nn.Module):
    """ResNet's basic block: two conv-bn, a strided 1x1 conv-bn shortcut, residual add."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = conv_bn(cin, cout, stride=stride)
        self.b = conv_bn(cout, cout, act=None)
        self.short = conv_bn(cin, cout, k=1, stride=stride, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(self.a(x)) + self.short(x))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8)
        self.layer1 = BasicBlock(8, 8, 1)
        self.layer2 = BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, 12)
        self.bn_fc = nn.BatchNorm1d(12)  # linear -> BatchNorm1d on (batch, features)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.stem(x))).mean((2, 3))
        return self.head(torch.relu(self.bn_fc(self.fc(h))))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand conv-bn-relu6, depthwise 3x3 conv-bn-relu6, 1x1 project conv-bn, add."""

    def __init__(self, c: int, expand: int) -> None:
        super().__init__()
        hidden = c * expand
        self.body = nn.Sequential(conv_bn(c, hidden, 1, act=nn.ReLU6), conv_bn(hidden, hidden, groups=hidden,
                                                                                act=nn.ReLU6),
                                  conv_bn(hidden, c, 1, act=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class TinyMobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 8, stride=2, act=nn.ReLU6)
        self.blocks = nn.Sequential(InvertedResidual(8, 3), InvertedResidual(8, 2))
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def trained_stats(model: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial affine parameters and running statistics (a few train-mode batches)."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias, std=0.3)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 16, 16) * 2 + 0.5)
    return model.eval()


def _bn_count(mg: ForgeGraph) -> int:
    return sum(isinstance(mg.model.get_submodule(str(n.target)), nn.modules.batchnorm._BatchNorm)
               for n in mg.model.graph.nodes if n.op == "call_module")


def _common(mg: ForgeGraph) -> dict[str, Any]:
    return {n.name: get_meta(n).common.to_json() for n in mg.model.graph.nodes}


@pytest.mark.parametrize("net, fused", [(TinyResNet, 8), (TinyMobileNet, 7)], ids=["resnet", "mobilenet"])
def test_fused_outputs_within_1e5_at_two_shapes(net: type[nn.Module], fused: int) -> None:
    model = trained_stats(net())
    mg = ForgeGraph(model, example_inputs=(torch.randn(2, 3, 16, 16),))
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    out, info = conv_bn_fusion_transform_pass(mg, None)
    assert len(info.fused) == fused and info.skipped == {} and info.changed
    assert _bn_count(out) == 0 and _bn_count(mg) == fused  # the input graph is left as it was
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for shape in ((2, 3, 16, 16), (3, 3, 24, 24)):
            x = torch.randn(*shape, generator=gen)
            ref = model(x)
            torch.testing.assert_close(out(x), ref, atol=1e-5, rtol=1e-5)
    fresh, _ = passes.add_common_metadata_analysis_pass(out.copy())
    assert _common(out) == _common(fresh)


@pytest.mark.slow  # HF capture of the ResNet: ~20 s on a loaded core; the blocks above stay in make test
def test_hf_resnet_fused() -> None:
    model = trained_stats(tiny_hf("resnet"))
    mg = ForgeGraph(model, hf_input_names=["pixel_values"])
    out, info = conv_bn_fusion_transform_pass(mg)
    assert len(info.fused) == 8 and _bn_count(out) == 0
    with torch.no_grad():
        for shape in ((2, 3, 32, 32), (1, 3, 40, 40)):
            x = torch.randn(*shape)
            torch.testing.assert_close(out(pixel_values=x).logits, model(pixel_values=x).logits, atol=1e-5, rtol=1e-5)


class Shared(nn.Module):
    """A conv whose output also feeds a second branch: its BatchNorm cannot be folded into it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.bn2(self.conv2(self.bn(h))) + h


def test_shared_output_skipped_and_training_mode_refused() -> None:
    model = trained_stats(Shared())
    x = torch.randn(2, 3, 8, 8)
    mg = ForgeGraph(model, example_inputs=(x,))
    out, info = conv_bn_fusion_transform_pass(mg)
    assert info.fused == [("conv2", "bn2")] and "also feeds" in info.skipped["bn"]
    with torch.no_grad():
        torch.testing.assert_close(out(x), model(x), atol=1e-5, rtol=1e-5)
    train = mg.copy().train()
    with pytest.raises(PassError, match=r"conv_bn_fusion_transform_pass.*training mode.*graph.eval\(\)"):
        conv_bn_fusion_transform_pass(train)
    kept, info = conv_bn_fusion_transform_pass(train, {"training": "skip"})
    assert info.fused == [] and info.skipped["bn2"].startswith("training mode") and _bn_count(kept) == 2
