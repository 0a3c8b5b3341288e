"""A stored tensor's memory layout, kept through a checkpoint.

safetensors holds contiguous data only. A tensor that is a permuted view (HF's Conv1D weight seen as an
nn.Linear's: the transpose of an ``[in, out]`` weight) is stored in its memory order with the order of its dims
recorded (``dim_order``), and loaded back as the same view. The layout decides which BLAS path a matmul takes
(``F.linear`` on the transposed view is eager's ``addmm(bias, x, W)``; on a contiguous copy it is
``addmm(bias, x, W.T)``, which rounds differently), so without it a reloaded graph is not bit-exact.
"""

from __future__ import annotations

from typing import Any

import torch

from .targets import CheckpointError

MAX_DIMS = 64  # the most dims a recorded shape may have (graph/checkpoint_load)


def dim_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, when ``t`` is a permutation of a contiguous
    tensor other than the identity; None for a contiguous tensor, or a layout no permutation makes contiguous
    (overlapping or gapped strides, stored as a contiguous copy)."""
    if t.is_contiguous():
        return None
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    return order if t.permute(order).is_contiguous() else None


def to_stored(t: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """The contiguous view of ``t`` in memory order that the checkpoint stores (``t`` itself without an order)."""
    return t if order is None else t.permute(order)


def from_stored(value: torch.Tensor, order: Any, shape: Any, where: str) -> torch.Tensor:
    """The tensor with the recorded ``shape`` whose memory order is ``order`` (hostile JSON: a permutation of
    the recorded dims, and the stored tensor's shape must be the recorded one permuted), as a view of ``value``."""
    if order is None:
        return value
    if not isinstance(shape, list) or not isinstance(order, list) or len(order) > MAX_DIMS \
            or not all(type(d) is int for d in order) or sorted(order) != list(range(len(shape))):
        raise CheckpointError(f"{where}: dim_order must be a permutation of the recorded shape's dims, "
                              f"got {str(order)[:80]}")
    stored = [shape[d] if type(shape[d]) is int else -1 for d in order]
    if list(value.shape) != stored:
        raise CheckpointError(f"{where}: the stored tensor is {tuple(value.shape)}; its recorded shape "
                              f"{tuple(shape)} in dim_order {order} is {tuple(stored)}")
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return value.permute(inverse)
