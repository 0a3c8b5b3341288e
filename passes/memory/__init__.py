"""Memory passes: activation checkpointing and buffer reuse, driven by the liveness analysis."""

from .activation_checkpoint import activation_checkpoint_transform_pass
from .buffer_reuse import buffer_reuse_transform_pass

__all__ = [
    "buffer_reuse_transform_pass",
    "activation_checkpoint_transform_pass",
]
