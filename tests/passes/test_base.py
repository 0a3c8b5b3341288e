"""The pass protocol: validated, never-mutated args; named errors; history; recompilation."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch.nn as nn

import fxforge
from fxforge import ForgeGraph, passes
from fxforge.passes.base import PASS_ALIASES, PASS_KINDS, PASSES, forge_pass
from fxforge.passes.contract import PROPERTIES, NumericalContract, PassInfo

PUBLIC_PASSES = sorted(n for n in fxforge.passes.__all__ if n.endswith(("_analysis_pass", "_transform_pass")))
# rooms above passes/ that define passes of their own (importing fxforge registers them)
ROOMS = (fxforge.hardware,)


def test_every_pass_is_exposed_by_name() -> None:
    registered = {n for n in PASSES if not n.startswith("_")}
    public = {(m, n) for m in (fxforge.passes, *ROOMS) for n in m.__all__
              if n.endswith(("_analysis_pass", "_transform_pass"))}
    assert registered == {getattr(m, n).pass_name for m, n in public}
    for module, name in public:
        fn = getattr(module, name)
        assert fn is passes.get_pass(name) is PASSES[fn.pass_name]
    assert PASS_ALIASES == {"calibrate_analysis_pass": "calibrate_transform_pass",
                            "buffer_reuse": "buffer_reuse_transform_pass"}
    with pytest.raises(KeyError, match="registered"):
        passes.get_pass("no_such_pass")


@pytest.mark.parametrize("name", sorted(n for n in PASSES if not n.startswith("_")))
def test_every_pass_declares_its_contract(name: str) -> None:
    """Args type, kind, declared properties, typed info; transforms a numerical contract."""
    spec = PASSES[name].spec
    assert spec.name == name and spec.kind in PASS_KINDS and name.endswith(f"_{spec.kind}_pass")
    assert dataclasses.is_dataclass(spec.args_type) and spec.args_type.__dataclass_params__.frozen
    assert issubclass(spec.info_type, PassInfo) and spec.info_type.__dataclass_params__.frozen
    for prop in (*spec.requires, *spec.forbids, *spec.ensures, *spec.invalidates):
        assert prop in PROPERTIES
    assert isinstance(spec.requires, tuple) and isinstance(spec.ensures, tuple)
    if spec.kind == "transform":
        assert isinstance(spec.contract, NumericalContract)
    else:
        assert spec.contract is None


def test_info_is_required() -> None:
    with pytest.raises(ValueError, match="PassInfo subclass"):
        forge_pass("analysis")(lambda g, a: (g, None))


def test_unknown_key_lists_allowed_keys(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(passes.PassArgsError) as info:
        passes.count_op_analysis_pass(mg, {"op": ("dropout",)})
    assert "unknown pass_args key(s) ['op']" in str(info.value) and "allowed keys: ['ops']" in str(info.value)
    with pytest.raises(passes.PassArgsError, match="allowed keys: \\[\\]"):
        passes.remove_dropout_transform_pass(mg, {"p": 0.1})


def test_wrong_type_is_an_error(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(passes.PassArgsError, match="ops"):
        passes.count_op_analysis_pass(mg, {"ops": 3})
    with pytest.raises(passes.PassArgsError, match="dict"):
        passes.count_op_analysis_pass(mg, ["ops"])  # type: ignore[arg-type]


def test_args_are_never_mutated(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    args: dict[str, Any] = {"ops": ["dropout", "linear"]}
    snapshot = copy.deepcopy(args)
    _, info = passes.count_op_analysis_pass(mg, args)
    assert args == snapshot and isinstance(args["ops"], list)
    assert info["counts"] == {"dropout": 6, "linear": 14}
    assert mg.history[-1].name == "count_op_analysis_pass"
    assert mg.history[-1].args == {"ops": ["dropout", "linear"]}


@dataclass(frozen=True)
class _BoomArgs:
    where: str = "here"


@pytest.fixture
def boom_pass(restore_registries: None) -> Callable[..., Any]:
    """A transform that always fails, registered for one test only."""

    @forge_pass("transform", _BoomArgs, info=PassInfo, contract=NumericalContract("exact"))
    def _boom_transform_pass(graph: ForgeGraph, args: _BoomArgs) -> tuple[ForgeGraph, PassInfo]:
        raise RuntimeError(f"exploded {args.where}")

    return _boom_transform_pass


def test_failures_name_the_pass(tiny_bert: nn.Module, boom_pass: Callable[..., Any]) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(passes.PassError, match="_boom_transform_pass failed: RuntimeError: exploded there"):
        boom_pass(mg, {"where": "there"})
    assert not mg.history  # a failed pass is not recorded
    with pytest.raises(TypeError, match="expected a ForgeGraph"):
        passes.count_op_analysis_pass(tiny_bert)
    with pytest.raises(ValueError, match="already registered"):
        forge_pass("analysis", info=PassInfo)(passes.count_op_analysis_pass.__wrapped__)
    with pytest.raises(ValueError, match="pass kind"):
        forge_pass("mutation")  # type: ignore[arg-type]
