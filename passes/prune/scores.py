"""Importance scores per weight element: random, |w| (l1), w^2 (l2), |w * dL/dw| summed over calibration
batches (taylor, first-order Taylor, data-driven). Movement scores are recorded during training instead
(passes/prune/movement.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

from ..batching import iter_batches, run_batch
from .modules import MaskedLayer, layer_weight

__all__ = ["weight_scores", "unit_taylor_scores"]


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


def weight_scores(graph: Any, layers: Mapping[str, MaskedLayer], method: str, data: Any, num_batches: int,
                  loss_fn: Any, seed: int) -> dict[str, torch.Tensor]:
    """path -> score tensor shaped like the layer's weight (higher = more important)."""
    if method == "random":
        gen = torch.Generator().manual_seed(seed)
        return {p: torch.rand(m.weight.shape, generator=gen) for p, m in layers.items()}
    if method in ("l1", "l2"):
        return {p: (m.weight.detach().abs() if method == "l1" else m.weight.detach().float() ** 2)
                for p, m in layers.items()}
    acc = {p: torch.zeros_like(m.weight, dtype=torch.float32) for p, m in layers.items()}
    for _ in _backward_per_batch(graph, {p: m.weight for p, m in layers.items()}, data, num_batches, loss_fn):
        for p, m in layers.items():
            if m.weight.grad is not None:
                acc[p] += (m.weight.detach() * m.weight.grad).abs().float()
    return acc


def _backward_per_batch(graph: Any, weights: Mapping[str, torch.Tensor], data: Any, num_batches: int,
                        loss_fn: Any) -> Iterator[None]:
    """Run each calibration batch forward and backward in eval mode with the layers' ``weights`` requiring
    grad, yielding after each backward (the gradients are in ``.grad``); flags, grads and mode restored."""
    gm: fx.GraphModule = graph.model
    flags = {p: w.requires_grad for p, w in weights.items()}
    was = gm.training
    gm.eval()
    try:
        for w in weights.values():
            w.requires_grad_(True)
        seen = 0
        for batch in iter_batches(graph, data, num_batches):
            for prm in gm.parameters():
                prm.grad = None
            with torch.enable_grad():
                _loss(run_batch(gm, batch), batch, loss_fn).backward()
            yield
            seen += 1
        if seen == 0:
            raise ValueError("method 'taylor': 'data' yielded no batch")
    finally:
        for p, w in weights.items():
            w.requires_grad_(flags[p])
        for prm in gm.parameters():
            prm.grad = None
        gm.train(was)


def unit_taylor_scores(graph: Any, dep: Any, units: list[tuple[str, list[tuple[str, int]]]], data: Any,
                       num_batches: int, loss_fn: Any) -> list[float]:
    """First-order estimate of the loss change from removing each structured unit, summed over batches.

    Removing a unit zeroes what it feeds to the next Linear, so the estimate is |sum over that consumer's
    columns of w * dL/dw| (per batch, then summed): for a head this is the output projection's columns
    (the head-mask gradient of Michel et al., 2019), for an FFN unit the down projection's. Units that
    feed no Linear fall back to their own rows (weight and bias). Element-wise |w * g| sums, by
    contrast, cannot tell a unit whose contributions cancel from one the loss depends on.
    """
    gm: fx.GraphModule = graph.model
    index: dict[int, int] = {}
    for i, (_, rows) in enumerate(units):
        for p, r in rows:
            index[dep.find(dep.unit_of[(p, r)])] = i
    # consumer path -> (columns, unit indices); producer path -> (rows, unit indices) for the fallback
    consumer_lists: dict[str, tuple[list[int], list[int]]] = {}
    for c, cols in dep.columns.items():
        hit = [(col, index[dep.find(u)]) for col, u in cols.items() if dep.find(u) in index]
        if hit:
            consumer_lists[c] = ([col for col, _ in hit], [i for _, i in hit])
    fed = {i for _, idx in consumer_lists.values() for i in idx}
    producer_lists: dict[str, tuple[list[int], list[int]]] = {}
    for i, (_, rows) in enumerate(units):
        if i not in fed:
            for p, r in rows:
                producer_lists.setdefault(p, ([], []))
                producer_lists[p][0].append(r)
                producer_lists[p][1].append(i)
    consumers = {p: (torch.tensor(a), torch.tensor(b)) for p, (a, b) in consumer_lists.items()}
    producers = {p: (torch.tensor(a), torch.tensor(b)) for p, (a, b) in producer_lists.items()}
    paths = set(consumers) | set(producers)
    weights = {p: layer_weight(gm.get_submodule(p)) for p in paths}
    biases = {p: getattr(gm.get_submodule(p), "bias", None) for p in producers}
    total = torch.zeros(len(units), dtype=torch.float64)
    for _ in _backward_per_batch(graph, weights, data, num_batches, loss_fn):
        step = torch.zeros(len(units), dtype=torch.float64)
        for p, (cols, idx) in consumers.items():
            w = weights[p]
            if w.grad is not None:
                per_col = (w.detach() * w.grad).double().sum(0)
                step.index_add_(0, idx, per_col[cols])
        for p, (row_index, idx) in producers.items():
            w, b = weights[p], biases[p]
            if w.grad is None:
                continue
            per_row = (w.detach() * w.grad).double().flatten(1).sum(1)
            if isinstance(b, torch.Tensor) and b.grad is not None:
                per_row = per_row + (b.detach() * b.grad).double()
            step.index_add_(0, idx, per_row[row_index])
        total += step.abs()
    return total.tolist()
