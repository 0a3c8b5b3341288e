"""verify_{common,software,}_metadata_analysis_pass: fxforge's invariant "metadata equals a fresh analysis".

Every transform leaves metadata equal to what the metadata passes compute afresh (the rewrite engine derives
it). These passes check that on demand, MASE's names for it: the common section of every node is compared
field by field with a fresh analysis of a copy of the graph (the graph itself is not touched), and the
software section is checked against what can be recomputed (entries) or must hold (registered records that
round-trip through JSON, statistics on the node's own entries, finite, min <= max, variance >= 0). Every
mismatch is reported, not the first; by default the pass then fails listing them (MASE's verify asserts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import CommonMeta, MetaSection, get_meta, has_meta
from ..base import forge_pass
from ..contract import PassInfo
from ..propagate import init_node, propagate_graph
from .software_metadata import SoftwareEntriesRecord, software_entries
from .statistics import StatisticsRecord

__all__ = ["Mismatch", "VerifyArgs", "VerifyInfo", "common_mismatches", "software_mismatches",
           "verify_common_metadata_analysis_pass", "verify_metadata_analysis_pass",
           "verify_software_metadata_analysis_pass"]

SHOWN = 20  # mismatches spelled out in the error (the info holds all of them)


@dataclass(frozen=True)
class VerifyArgs:
    """dummy_in: inputs of the fresh analysis (default: the graph's example inputs; give the ones the
    metadata was recorded with); raise_on_mismatch: fail listing every mismatch (False: report in the info)."""

    dummy_in: Any = None
    raise_on_mismatch: bool = True


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: ``where`` is a path such as ``common.args.data_in_0.shape``."""

    node: str
    where: str
    recorded: Any
    expected: Any

    def __str__(self) -> str:
        return f"{self.node}: {self.where} is {self.recorded!r}, expected {self.expected!r}"


@dataclass(frozen=True)
class VerifyInfo(PassInfo):
    """ok: no mismatch; nodes: nodes checked; mismatches: every one found."""

    ok: bool
    nodes: int
    mismatches: tuple[Mismatch, ...] = ()


def _compare_values(node: str, where: str, recorded: dict[str, Any], fresh: dict[str, Any]) -> list[Mismatch]:
    out = []
    for key in sorted(set(recorded) | set(fresh), key=str):
        if key not in fresh:
            out.append(Mismatch(node, f"{where}.{key}", recorded[key], "(absent)"))
        elif key not in recorded:
            out.append(Mismatch(node, f"{where}.{key}", "(absent)", fresh[key]))
        elif recorded[key] != fresh[key]:
            for field, value in fresh[key].items():
                if recorded[key].get(field) != value:
                    out.append(Mismatch(node, f"{where}.{key}.{field}", recorded[key].get(field), value))
    return out


def _compare_common(node: str, recorded: CommonMeta, fresh: CommonMeta) -> list[Mismatch]:
    mine, theirs = recorded.to_json(), fresh.to_json()
    out = [Mismatch(node, f"common.{k}", mine[k], theirs[k])
           for k in ("kind", "op", "module_type") if mine[k] != theirs[k]]
    for section in ("args", "results"):
        out += _compare_values(node, f"common.{section}", mine[section], theirs[section])
    return out


def common_mismatches(graph: ForgeGraph, dummy_in: Any = None) -> tuple[int, list[Mismatch]]:
    """(nodes checked, mismatches) of every node's common metadata against a fresh analysis of a copy."""
    example = graph.example_inputs if dummy_in is None else ExampleInputs.coerce(dummy_in)
    if example is None:
        raise ValueError("no inputs for the fresh analysis: pass {'dummy_in': ...} (the inputs the metadata was "
                         "recorded with) or capture with example_inputs")
    fresh = graph.copy()
    for node in fresh.model.graph.nodes:
        init_node(node, fresh.model)
    propagate_graph(fresh.model, example)
    again = {n.name: get_meta(n).common for n in fresh.model.graph.nodes}
    out: list[Mismatch] = []
    nodes = list(graph.model.graph.nodes)
    for node in nodes:
        if node.name not in again:
            out.append(Mismatch(node.name, "node", "(present)", "(absent from a fresh capture of the graph)"))
        elif not has_meta(node):
            out.append(Mismatch(node.name, "metadata", "(absent)", "init_metadata_analysis_pass's record"))
        else:
            out += _compare_common(node.name, get_meta(node).common, again[node.name])
    return len(nodes), out


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _statistics_mismatches(node: str, record: StatisticsRecord, entries: SoftwareEntriesRecord) -> list[Mismatch]:
    out = []
    known = set(entries.args) | set(entries.results)
    for entry, stats in record.stats.items():
        where = f"software.statistics.{entry}"
        if entry not in known:
            out.append(Mismatch(node, where, "(present)", f"one of the node's entries {sorted(known)}"))
        for stat, values in stats.items():
            bad = [k for k, v in values.items() if not _finite(v)]
            out += [Mismatch(node, f"{where}.{stat}.{k}", values[k], "a finite number") for k in bad]
            if "min" in values and "max" in values and not values["min"] <= values["max"]:
                out.append(Mismatch(node, f"{where}.{stat}.min", values["min"], f"<= max ({values['max']})"))
            if values.get("variance", 0.0) < 0:
                out.append(Mismatch(node, f"{where}.{stat}.variance", values["variance"], ">= 0"))
    return out


def _software_node(node: fx.Node, gm: fx.GraphModule) -> list[Mismatch]:
    meta = get_meta(node)
    out = []
    for name, section in (("software", meta.software), ("hardware", meta.hardware)):
        try:
            again = MetaSection.from_json(section.to_json())
        except (TypeError, ValueError) as exc:
            out.append(Mismatch(node.name, name, "(not JSON)", f"JSON values only ({type(exc).__name__}: {exc})"))
            continue
        if again != section:
            out.append(Mismatch(node.name, name, section.to_json(), "the same records after a JSON round trip"))
    entries = meta.software.get(SoftwareEntriesRecord)
    if entries is not None:
        fresh = software_entries(node, gm)
        for field in ("args", "results"):
            if getattr(entries, field) != getattr(fresh, field):
                out.append(Mismatch(node.name, f"software.entries.{field}", getattr(entries, field),
                                    getattr(fresh, field)))
        stats = meta.software.get(StatisticsRecord)
        if stats is not None:
            out += _statistics_mismatches(node.name, stats, fresh)
    return out


def software_mismatches(graph: ForgeGraph) -> tuple[int, list[Mismatch]]:
    """(nodes checked, mismatches) of every node's software and hardware records (see the module docstring)."""
    nodes = list(graph.model.graph.nodes)
    out: list[Mismatch] = []
    for node in nodes:
        if not has_meta(node):
            out.append(Mismatch(node.name, "metadata", "(absent)", "init_metadata_analysis_pass's record"))
        else:
            out += _software_node(node, graph.model)
    return len(nodes), out


def _finish(nodes: int, found: list[Mismatch], args: VerifyArgs) -> VerifyInfo:
    if found and args.raise_on_mismatch:
        shown = "\n  ".join(str(m) for m in found[:SHOWN])
        more = f"\n  ... {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise ValueError(f"{len(found)} metadata mismatch(es) in {nodes} nodes (re-run the metadata passes, or "
                         f"pass raise_on_mismatch=False to get them in the info):\n  {shown}{more}")
    return VerifyInfo(ok=not found, nodes=nodes, mismatches=tuple(found))


@forge_pass("analysis", VerifyArgs, info=VerifyInfo, requires=("metadata",))
def verify_common_metadata_analysis_pass(graph: ForgeGraph, args: VerifyArgs) -> tuple[ForgeGraph, VerifyInfo]:
    """Compare every node's common metadata with a fresh analysis; report every mismatch."""
    nodes, found = common_mismatches(graph, args.dummy_in)
    return graph, _finish(nodes, found, args)


@dataclass(frozen=True)
class VerifySoftwareArgs:
    """raise_on_mismatch: fail listing every mismatch (False: report them in the info)."""

    raise_on_mismatch: bool = True


@forge_pass("analysis", VerifySoftwareArgs, info=VerifyInfo, requires=("metadata",))
def verify_software_metadata_analysis_pass(graph: ForgeGraph,
                                           args: VerifySoftwareArgs) -> tuple[ForgeGraph, VerifyInfo]:
    """Check every node's software/hardware records (JSON round trip, entries, statistics); report every mismatch."""
    nodes, found = software_mismatches(graph)
    full = VerifyArgs(raise_on_mismatch=args.raise_on_mismatch)
    return graph, _finish(nodes, found, full)


@forge_pass("analysis", VerifyArgs, info=VerifyInfo, requires=("metadata",))
def verify_metadata_analysis_pass(graph: ForgeGraph, args: VerifyArgs) -> tuple[ForgeGraph, VerifyInfo]:
    """Both checks, common then software; every mismatch of either is reported."""
    nodes, found = common_mismatches(graph, args.dummy_in)
    found += software_mismatches(graph)[1]
    return graph, _finish(nodes, found, args)
