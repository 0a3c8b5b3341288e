"""Small fixed-point models for the hardware tests: an MLP classifier and a transformer FFN block."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.passes import quantize_transform_pass


class MLP(nn.Module):
    """in -> hidden -> ReLU -> classes, argmax (the classifier) optional."""

    def __init__(self, sizes: tuple[int, int, int] = (8, 16, 4), argmax: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(sizes[0], sizes[1]), nn.Linear(sizes[1], sizes[2])
        self.argmax = argmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(torch.relu(self.fc1(x)))
        return y.argmax(-1) if self.argmax else y


class FFNBlock(nn.Module):
    """A transformer layer's FFN block: x + W2 relu(W1 x), then a classifier head."""

    def __init__(self, d: int = 8, hidden: int = 16, classes: int = 4, head: bool = True,
                 argmax: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.head = nn.Linear(d, classes) if head else None
        self.argmax = argmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.fc2(torch.relu(self.fc1(x)))
        y = y if self.head is None else self.head(y)
        return y.argmax(-1) if self.argmax else y


def fixed_config(width: int, frac: int, weight_frac: int | None = None, out_frac: int | None = None) -> dict[str, Any]:
    """Every op's data_in / weight / bias / data_out in ``width``-bit fixed point."""
    wf = frac if weight_frac is None else weight_frac
    of = frac if out_frac is None else out_frac
    return {"by": "type", "default": {"config": {
        "name": "integer", "data_in_width": width, "data_in_frac_width": frac, "weight_width": width,
        "weight_frac_width": wf, "bias_width": width, "bias_frac_width": wf, "data_out_width": width,
        "data_out_frac_width": of}}}


def quantized(model: nn.Module, config: dict[str, Any], features: int = 8, seed: int = 0) -> ForgeGraph:
    """``model`` (weights drawn with ``seed``, scaled up so saturation happens) captured and quantized."""
    torch.manual_seed(seed)
    for p in model.parameters():
        nn.init.uniform_(p, -1.5, 1.5)
    graph = ForgeGraph(model.eval(), (torch.randn(4, features),))
    return quantize_transform_pass(graph, config)[0]


def sample_inputs(n: int, features: int, scale: float, seed: int = 1) -> torch.Tensor:
    """Random inputs with a share of large values (they saturate the input format) and negatives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g) * scale
    big = torch.rand(n, features, generator=g) < 0.1
    return torch.where(big, torch.sign(x) * scale * 20, x)
