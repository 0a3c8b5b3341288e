"""Capture, IR, metadata and checkpoints."""

# Registers every torch.nn activation, normalisation and shape module with graph.targets (the checkpoint
# allowlist) whenever any part of graph/ is imported, so writing and reading checkpoints always sees them.
from . import nn_modules  # noqa: F401
