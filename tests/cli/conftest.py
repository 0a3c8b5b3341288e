"""Fixtures for the CLI tests: a small exported checkpoint shared by the session."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.fxforge"
    return path, make_checkpoint(path)
