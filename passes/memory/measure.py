"""measure_training_peak: the real peak memory of one training step (forward + backward), from the allocator.

The figure is the liveness analysis's step measurement (passes/analysis/step_memory.measured_step_bytes): the
CPU allocator's per-allocation ``[memory]`` events (torch.profiler) summed in time order, peak above the
step's start, with every trainable weight's ``.grad`` allocated and zeroed before (restored after), so it
counts activations, their gradients in flight, temporaries and recomputation, not weights or weight grads.
The step's scalar is the sum of the graph's floating outputs that require grad (a loss counts as one).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..analysis.step_memory import measured_step_bytes

__all__ = ["measure_training_peak"]


def measure_training_peak(gm: fx.GraphModule, flat_inputs: list[Any]) -> int:
    """Bytes: the allocator's peak during ``gm(*flat_inputs)`` and its backward, above the level before it."""
    return measured_step_bytes(gm, flat_inputs)
