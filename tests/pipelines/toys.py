"""Test-only passes for pipeline tests, registered by the ``toy_passes`` fixture and removed afterwards
(test modules import the fixture and mark themselves with it), and a small graph."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.passes.base import forge_pass
from fxforge.passes.contract import NumericalContract, PassInfo, register_property

CALLS: list[tuple[str, int]] = []


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


@pytest.fixture
def toy_passes(restore_registries: None) -> Iterator[SimpleNamespace]:
    """_exact_scale_pass (promises exact outputs: broken unless factor == 1), _bounded_scale_pass
    (bounded, no threshold), _mark_pass (ensures '_marked'), _needs_mark_pass (requires it).
    CALLS lists (pass name, history length) for every call, to prove what ran."""
    calls = CALLS
    calls.clear()
    register_property("_marked", lambda g: bool(getattr(g.model, "_marked", False)), "the test marker is set")

    def scale(graph: ForgeGraph, args: ScaleArgs, name: str) -> tuple[ForgeGraph, ScaleInfo]:
        calls.append((name, len(graph.history)))
        with torch.no_grad():
            graph.model.get_submodule("0").weight.mul_(args.factor)
        return graph, ScaleInfo(factor=args.factor)

    @forge_pass("transform", ScaleArgs, info=ScaleInfo, contract=NumericalContract("exact", atol=1e-6, rtol=0.0))
    def _exact_scale_pass(graph, args):
        return scale(graph, args, "_exact_scale_pass")

    @forge_pass("transform", ScaleArgs, info=ScaleInfo, contract=NumericalContract("bounded"))
    def _bounded_scale_pass(graph, args):
        return scale(graph, args, "_bounded_scale_pass")

    @forge_pass("transform", ScaleArgs, info=ScaleInfo, ensures=("_marked",))
    def _mark_pass(graph, args):
        graph.model._marked = True
        return scale(graph, args, "_mark_pass")

    @forge_pass("analysis", ScaleArgs, info=ScaleInfo, requires=("_marked",))
    def _needs_mark_pass(graph, args):
        calls.append(("_needs_mark_pass", len(graph.history)))
        return graph, ScaleInfo(factor=0.0)

    yield SimpleNamespace(exact=_exact_scale_pass, bounded=_bounded_scale_pass, mark=_mark_pass,
                          needs_mark=_needs_mark_pass, calls=calls)
