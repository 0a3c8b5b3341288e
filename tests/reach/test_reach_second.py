"""The other half of ``make test``'s representative architectures (tests/reach/test_reach.py says what each must
pass): a second file, so ``--dist loadfile`` runs the two halves on the two workers at once."""

from __future__ import annotations

import pytest
from reach_checks import cases, check_reach, check_train
from reach_stages import Run
from tiny_archs import SECOND_FILE

CASES = cases(SECOND_FILE)


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """name -> its Run (the train-mode test reuses the graph test_reach captured)."""
    return {}


@pytest.mark.parametrize("name", CASES)
def test_reach(runs: dict[str, Run], name: str) -> None:
    check_reach(runs, name)


@pytest.mark.parametrize("name", CASES)
def test_train_mode_equals_eager_or_refuses(runs: dict[str, Run], name: str) -> None:
    check_train(runs, name)
