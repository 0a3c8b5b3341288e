"""Capture, IR, metadata and checkpoints."""
