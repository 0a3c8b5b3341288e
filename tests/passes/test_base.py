"""The pass protocol: validated, never-mutated args; named errors; history; recompilation."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import fxforge
import pytest
import torch.nn as nn
from fxforge import ForgeGraph, passes
from fxforge.passes.base import PASSES, forge_pass


def test_every_pass_is_exposed_by_name() -> None:
    for name in ("init_metadata_analysis_pass", "add_common_metadata_analysis_pass", "count_op_analysis_pass",
                 "remove_dropout_transform_pass", "report_graph_analysis_pass",
                 "report_trainable_parameters_analysis_pass"):
        assert getattr(fxforge.passes, name) is PASSES[name] is passes.get_pass(name)
    with pytest.raises(KeyError, match="registered"):
        passes.get_pass("no_such_pass")


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


@forge_pass("transform", _BoomArgs)
def _boom_transform_pass(graph: ForgeGraph, args: _BoomArgs) -> tuple[ForgeGraph, dict[str, Any]]:
    raise RuntimeError(f"exploded {args.where}")


def test_failures_name_the_pass(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(passes.PassError, match="_boom_transform_pass failed: RuntimeError: exploded there"):
        _boom_transform_pass(mg, {"where": "there"})
    assert not mg.history  # a failed pass is not recorded
    with pytest.raises(TypeError, match="expected a ForgeGraph"):
        passes.count_op_analysis_pass(tiny_bert)
    with pytest.raises(ValueError, match="already registered"):
        forge_pass("analysis")(passes.count_op_analysis_pass.__wrapped__)
    with pytest.raises(ValueError, match="pass kind"):
        forge_pass("mutation")  # type: ignore[arg-type]
