"""One home for running a graph over batches: what counts as a batch, how to call a model on one.

Calibration, quantization reports, pipeline contract checks and search objectives all iterate the
same way; batches are data and are passed by reference (never deep-copied).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..graph.inputs import ExampleInputs

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph

__all__ = ["iter_batches", "run_batch", "evaluating"]


def iter_batches(graph: ForgeGraph, data: Any, num_batches: int | None) -> Iterator[Any]:
    """The batches to run: ``data`` (one batch or an iterable of them) or the graph's example inputs."""
    if data is None:
        if graph.example_inputs is None:
            raise ValueError("no data: pass {'data': [batch, ...]} or capture with example_inputs")
        batches: Iterable[Any] = [graph.example_inputs]
    elif isinstance(data, dict | torch.Tensor | ExampleInputs):
        batches = [data]
    elif isinstance(data, Iterable):
        batches = data
    else:
        raise TypeError(f"data must be a batch or an iterable of batches, got {type(data).__name__}")
    it = iter(batches)
    return itertools.islice(it, num_batches) if num_batches is not None else it


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode without grad for the block (dropout off, deterministic); the model's mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def run_batch(model: Any, batch: Any) -> Any:
    """Call ``model`` on a batch given as kwargs dict, args tuple/list, tensor or ExampleInputs."""
    if isinstance(batch, ExampleInputs):
        return model(*batch.args, **batch.kwargs)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)
