"""Importance scores per weight element: random, |w| (l1), w^2 (l2), |w * dL/dw| summed over calibration
batches (taylor, first-order Taylor / movement-style, data-driven)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..batching import iter_batches, run_batch

__all__ = ["weight_scores"]


def _loss(output: Any, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("method 'taylor' needs a scalar loss: the model's output has no 'loss' "
                         "(give batches with labels, or pass loss_fn(output, batch))")
    return loss


def weight_scores(graph: Any, layers: dict[str, nn.Module], method: str, data: Any, num_batches: int,
                  loss_fn: Any, seed: int) -> dict[str, torch.Tensor]:
    """path -> score tensor shaped like the layer's weight (higher = more important)."""
    if method == "random":
        gen = torch.Generator().manual_seed(seed)
        return {p: torch.rand(m.weight.shape, generator=gen) for p, m in layers.items()}
    if method in ("l1", "l2"):
        return {p: (m.weight.detach().abs() if method == "l1" else m.weight.detach().float() ** 2)
                for p, m in layers.items()}
    gm: fx.GraphModule = graph.model
    flags = {p: m.weight.requires_grad for p, m in layers.items()}
    acc = {p: torch.zeros_like(m.weight, dtype=torch.float32) for p, m in layers.items()}
    was = gm.training
    gm.eval()
    try:
        for m in layers.values():
            m.weight.requires_grad_(True)
            m.weight.grad = None
        seen = 0
        for batch in iter_batches(graph, data, num_batches):
            with torch.enable_grad():
                _loss(run_batch(gm, batch), batch, loss_fn).backward()
            for p, m in layers.items():
                if m.weight.grad is not None:
                    acc[p] += (m.weight.detach() * m.weight.grad).abs().float()
                    m.weight.grad = None
            seen += 1
        if seen == 0:
            raise ValueError("method 'taylor': 'data' yielded no batch")
    finally:
        for p, m in layers.items():
            m.weight.requires_grad_(flags[p])
        for prm in gm.parameters():
            prm.grad = None
        gm.train(was)
    return acc
