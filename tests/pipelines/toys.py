"""Helpers for pipeline tests: a small graph and the args/info of the test-only passes (tests/pipelines/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from fxforge import ForgeGraph
from fxforge.passes.contract import PassInfo


@dataclass(frozen=True)
class ScaleArgs:
    """factor: multiply the first linear's weight by this."""

    factor: float = 1.0


@dataclass(frozen=True)
class ScaleInfo(PassInfo):
    factor: float


def small_graph() -> ForgeGraph:
    torch.manual_seed(0)
    return ForgeGraph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval(), torch.randn(5, 4))
