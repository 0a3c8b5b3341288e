"""Shared fixture for the attack tests: one pristine export-captured checkpoint per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from security_helpers import tiny_graph


@pytest.fixture(scope="session")
def export_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny export-captured graph (keyword input: a dict in its input structure), exported once."""
    return tiny_graph("export").export(tmp_path_factory.mktemp("pristine") / "ckpt")
