"""Raising fx to the fxforge IR: init_metadata_analysis_pass and add_common_metadata_analysis_pass.

The work itself lives in passes/propagate.py, shared with the rewrite engine (which derives the same
metadata for the nodes a transform creates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import get_meta
from ..base import NoArgs, forge_pass
from ..contract import PassInfo
from ..propagate import flat_inputs, init_node, propagate_graph

__all__ = ["init_metadata_analysis_pass", "add_common_metadata_analysis_pass", "CommonMetadataArgs",
           "InitMetadataInfo", "CommonMetadataInfo", "flat_inputs"]


@dataclass(frozen=True)
class InitMetadataInfo(PassInfo):
    """nodes: how many nodes got metadata; kinds: node count per kind."""

    nodes: int
    kinds: dict[str, int] = field(default_factory=dict)


@forge_pass("analysis", NoArgs, info=InitMetadataInfo, ensures=("metadata",), invalidates=("shapes",))
def init_metadata_analysis_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, InitMetadataInfo]:
    """Give every node a fresh NodeMeta with its kind and canonical op (MASE's first raising pass)."""
    kinds: dict[str, int] = {}
    for node in graph.model.graph.nodes:
        init_node(node, graph.model)
        kind = get_meta(node).common.kind.value
        kinds[kind] = kinds.get(kind, 0) + 1
    return graph, InitMetadataInfo(nodes=sum(kinds.values()), kinds=kinds)


@dataclass(frozen=True)
class CommonMetadataArgs:
    """dummy_in: inputs to propagate (a tensor, tuple of args, dict of kwargs); default: the
    graph's example inputs (HF models get them built from hf_input_names at capture).
    add_value: MASE's switch for storing tensor values; only False (what fxforge always does) is accepted."""

    dummy_in: Any = None
    add_value: bool = False

    def __post_init__(self) -> None:
        if self.add_value is not False:
            raise ValueError("'add_value': fxforge metadata records shapes, dtypes and precisions, never tensor "
                             "values; drop the key or pass False")


@dataclass(frozen=True)
class CommonMetadataInfo(PassInfo):
    """nodes: nodes in the graph; complex_nodes: nodes with a complex result (the AFNO FFT path)."""

    nodes: int
    complex_nodes: int


@forge_pass("analysis", CommonMetadataArgs, info=CommonMetadataInfo, ensures=("metadata", "shapes"))
def add_common_metadata_analysis_pass(graph: ForgeGraph, args: CommonMetadataArgs) -> tuple[ForgeGraph,
                                                                                           CommonMetadataInfo]:
    """Propagate shapes, dtypes (complex included) and precisions by running the graph once.

    Runs torch.fx's Interpreter under no_grad in eval mode (dropout off, deterministic) and restores
    the graph's mode afterwards. Nodes without metadata get it initialised first.
    """
    example = graph.example_inputs if args.dummy_in is None else ExampleInputs.coerce(args.dummy_in)
    if example is None:
        raise ValueError("no inputs to propagate: pass {'dummy_in': ...} or capture with example_inputs")
    gm = graph.model
    propagate_graph(gm, example)
    complex_nodes = sum(
        1 for n in gm.graph.nodes
        if any(v.dtype and v.dtype.startswith("complex") for v in get_meta(n).common.results.values())
    )
    return graph, CommonMetadataInfo(nodes=len(gm.graph.nodes), complex_nodes=complex_nodes)
