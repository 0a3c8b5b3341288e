"""The reach tests' shared fixture: each test module keeps the runs its reach test made, for its train-mode test."""

from __future__ import annotations

import pytest
from reach_stages import Run


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """name -> its Run through the stages test_reach got through (the train-mode test reuses its graph)."""
    return {}
