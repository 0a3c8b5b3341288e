"""The pass contract: requires / forbids / ensures checked by the decorator, typed infos, static order checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph, passes
from fxforge.passes.base import PASSES, PassError, forge_pass
from fxforge.passes.contract import (
    PROPERTIES,
    ContractError,
    NumericalContract,
    PassInfo,
    current_properties,
    plan_properties,
    register_property,
)


@dataclass(frozen=True)
class _Info(PassInfo):
    count: int
    names: tuple[str, ...] = ()


@pytest.fixture
def scratch_passes() -> Iterator[list[str]]:
    """Names registered by a test are removed afterwards, with the test-only property."""
    names: list[str] = []
    yield names
    for n in names:
        PASSES.pop(n, None)
    PROPERTIES.pop("_marked", None)


def _graph() -> ForgeGraph:
    return ForgeGraph(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4))


def test_requires_and_ensures_checked_with_uniform_errors(scratch_passes: list[str]) -> None:
    register_property("_marked", lambda g: getattr(g.model, "_marked", False), "the test marker is set")

    @forge_pass("transform", info=_Info, ensures=("_marked",))
    def _mark_pass(graph, args):
        graph.model._marked = True
        return graph, _Info(count=1)

    @forge_pass("analysis", info=_Info, requires=("_marked", "metadata"))
    def _needs_mark_pass(graph, args):
        return graph, _Info(count=2)

    @forge_pass("transform", info=_Info, ensures=("_marked",))
    def _liar_pass(graph, args):
        return graph, _Info(count=0)

    scratch_passes += ["_mark_pass", "_needs_mark_pass", "_liar_pass"]
    mg = _graph()
    with pytest.raises(PassError, match=r"requires '_marked'.*run _liar_pass or _mark_pass first"):
        _needs_mark_pass(mg)
    with pytest.raises(PassError, match=r"_liar_pass promised \['_marked'\]"):
        _liar_pass(mg)
    mg, info = _mark_pass(mg)
    assert info.count == 1 and info["count"] == 1 and info.to_json() == {"count": 1, "names": [], "changed": True}
    mg, _ = passes.init_metadata_analysis_pass(mg)
    _, info = _needs_mark_pass(mg)
    assert info.count == 2
    assert [r.name for r in mg.history] == ["_mark_pass", "init_metadata_analysis_pass", "_needs_mark_pass"]


def test_forbids_and_wrong_info_type(scratch_passes: list[str]) -> None:
    @forge_pass("analysis", info=_Info, forbids=("metadata",))
    def _before_meta_pass(graph, args):
        return graph, {"count": 1}

    scratch_passes.append("_before_meta_pass")
    mg = _graph()
    with pytest.raises(PassError, match="returned info of type dict, declared _Info"):
        _before_meta_pass(mg)
    mg, _ = passes.init_metadata_analysis_pass(mg)
    with pytest.raises(PassError, match="cannot run on a graph where 'metadata' holds"):
        _before_meta_pass(mg)


def test_declarations_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown graph propert"):
        forge_pass("analysis", info=_Info, requires=("no-such-property",))(lambda g, a: (g, None))
    with pytest.raises(ValueError, match="only transform passes"):
        forge_pass("analysis", info=_Info, contract=NumericalContract("exact"))(lambda g, a: (g, None))
    with pytest.raises(ValueError, match="unknown contract threshold"):
        NumericalContract("bounded").with_thresholds(tolerance=1)


def test_plan_properties_checks_an_order_statically(scratch_passes: list[str]) -> None:
    register_property("_marked", lambda g: False, "the test marker is set")

    @forge_pass("transform", info=_Info, ensures=("_marked",))
    def _mark_pass(graph, args):
        return graph, _Info(count=1)

    @forge_pass("transform", info=_Info, requires=("_marked",), invalidates=("_marked",))
    def _consume_pass(graph, args):
        return graph, _Info(count=1)

    scratch_passes += ["_mark_pass", "_consume_pass"]
    start = current_properties(_graph())
    assert "_marked" not in start and "metadata" not in start
    mark, consume = _mark_pass.spec, _consume_pass.spec
    states = plan_properties([mark, consume], start, PASSES)
    assert "_marked" in states[1]
    with pytest.raises(ContractError, match=r"step 1 \(_consume_pass\) requires '_marked'"):
        plan_properties([consume, mark], start, PASSES)
    with pytest.raises(ContractError, match=r"step 3 \(_consume_pass\)"):
        plan_properties([mark, consume, consume], start, PASSES)
