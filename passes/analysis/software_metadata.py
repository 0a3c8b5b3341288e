"""add_software_metadata_analysis_pass: each node's software entries, the names software passes annotate.

MASE's pass gives every node a ``software`` section keyed by its arguments (``data_in_0``...), its module's
parameters and buffers, and its results (``data_out_0``...), each with an empty ``stat`` slot that the
statistics profiler fills. fxforge's software section is typed: this pass records one
:class:`SoftwareEntriesRecord` per node listing those entry names, computed from the common metadata (so
it needs shapes), and ``profile_statistics_analysis_pass`` writes its statistics under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import MetaRecord, get_meta, register_record
from ..base import NoArgs, forge_pass
from ..contract import PassInfo

__all__ = ["SoftwareEntriesRecord", "SoftwareMetadataInfo", "add_software_metadata_analysis_pass",
           "software_entries"]


@register_record("software.entries")
@dataclass
class SoftwareEntriesRecord(MetaRecord):
    """args: tensor inputs (``data_in_*``, keyword names), the module's parameters and buffers; results:
    tensor results (``data_out_*``)."""

    args: tuple[str, ...] = ()
    results: tuple[str, ...] = ()


@dataclass(frozen=True)
class SoftwareMetadataInfo(PassInfo):
    """nodes: nodes given a record; entries: argument and result entries over all of them."""

    nodes: int
    entries: int


def software_entries(node: fx.Node, gm: fx.GraphModule) -> SoftwareEntriesRecord:
    """The entries a fresh add_software_metadata_analysis_pass records for ``node`` (shared with verify)."""
    common = get_meta(node).common
    args = [k for k, v in common.args.items() if v.type == "tensor"]
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        args += [name for name, _ in module.named_buffers(recurse=False) if name not in args]
    results = [k for k, v in common.results.items() if v.type == "tensor"]
    return SoftwareEntriesRecord(args=tuple(args), results=tuple(results))


@forge_pass("analysis", NoArgs, info=SoftwareMetadataInfo, requires=("shapes",))
def add_software_metadata_analysis_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, SoftwareMetadataInfo]:
    """Record every node's software entries (MASE's software section) from its common metadata."""
    gm = graph.model
    entries = 0
    for node in gm.graph.nodes:
        record = software_entries(node, gm)
        get_meta(node).software.set(record)
        entries += len(record.args) + len(record.results)
    return graph, SoftwareMetadataInfo(nodes=len(gm.graph.nodes), entries=entries)
