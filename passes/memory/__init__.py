"""Memory passes: activation checkpointing and buffer reuse, driven by the liveness analysis."""

from .buffer_reuse import buffer_reuse_transform_pass

__all__ = [
    "buffer_reuse_transform_pass",
]
