"""measure_training_peak: the real peak memory of one training step (forward + backward), from the allocator.

The CPU allocator's per-allocation ``[memory]`` events (torch.profiler, ``profile_memory=True``) are summed in
time order; the peak is the highest level above the step's start. Every trainable weight's ``.grad`` is
allocated and zeroed before the step (as in a loop that zeroes rather than frees them) and restored after,
so the figure is activations, their gradients in flight, temporaries and recomputation, not weight grads.
The step's scalar is the sum of the graph's floating outputs that require grad (the loss counts as one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["measure_training_peak"]


def _step_scalar(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("measure_training_peak: no output requires grad (are all parameters frozen?)")
    return torch.stack([t.sum() for t in leaves]).sum()


def measure_training_peak(gm: nn.Module, flat_inputs: list[Any]) -> int:
    """Bytes: the allocator's peak during ``gm(*flat_inputs)`` and its backward, above the level before it."""
    from torch.profiler import ProfilerActivity, profile

    params = [p for p in gm.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        with torch.enable_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _step_scalar(gm(*flat_inputs)).backward()
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("measure_training_peak: the profiler returned no results")
    level = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]"):
        level += nbytes
        peak = max(peak, level)
    return peak
