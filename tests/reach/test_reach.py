"""Architecture reach: every tiny transformers model raw eval-mode torch.export takes, fxforge captures, equals
eager exactly at two shapes (padded masks included), annotates with the metadata passes, quantizes (every linear,
8 bits) and runs, and round-trips through a checkpoint with 0 difference; in train mode the graph equals eager
under the same seed or refuses training.

A model raw torch.export cannot take either is not expected of fxforge: its case checks that raw export fails and
passes. ``make test`` runs the REPRESENTATIVE ones (one per kind); the rest are marked ``reach`` (``make test-reach``).
"""

from __future__ import annotations

import pytest
from reach_checks import cases, check_reach, check_train
from reach_stages import Run
from tiny_archs import ARCHS, SECOND_FILE

CASES = cases([name for name in ARCHS if name not in SECOND_FILE])


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    """name -> its Run through the stages test_reach got through (the train-mode test reuses its graph)."""
    return {}


@pytest.mark.parametrize("name", CASES)
def test_reach(runs: dict[str, Run], name: str) -> None:
    check_reach(runs, name)


@pytest.mark.parametrize("name", CASES)
def test_train_mode_equals_eager_or_refuses(runs: dict[str, Run], name: str) -> None:
    check_train(runs, name)
