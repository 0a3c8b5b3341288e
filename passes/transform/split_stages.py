"""split_stages_transform_pass: cut a graph into N pipeline stages, balanced by the analyses' metadata.

The ops of the graph (in order) are cut at N-1 positions chosen to minimise the costliest stage, by latency
(profile_analysis_pass), memory (parameters + activations kept for backward, liveness_analysis_pass) or
parameter bytes (split_plan.py says where a cut may go). Each stage becomes a GraphModule ``stage_k`` the
top graph calls in a chain: stage k takes exactly the tensors crossing the cut before it and returns those
crossing the cut after it (values later stages need pass through), so the stages can run on separate
processes (fxforge.distributed.pipeline_run). Plain values (sizes, dtypes) are recomputed where they are
used, from tensors that cross. Stages call the very modules the graph called (aliases, as activation
checkpointing's regions do: a StageRegion, saved and loaded with the graph), so outputs equal the unsplit graph's
exactly.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ..base import PassArgsError, PassError, forge_pass
from ..contract import NumericalContract, PassInfo
from ..propagate import flat_inputs, propagate_graph
from ..rewrite import GraphRewrite
from .pipeline_stage import StageRegion, build_stage
from .split_plan import (
    ValueKinds,
    candidate_positions,
    choose_cuts,
    module_paths,
    op_costs,
    ops_of,
    remat_roots,
    value_kinds,
)

__all__ = ["SplitStagesArgs", "SplitStagesInfo", "split_stages_transform_pass", "stage_modules"]

_NAME = "split_stages_transform_pass"
STAGE_PREFIX = "stage_"


def stage_modules(graph: ForgeGraph) -> list[StageRegion]:
    """The stages of a split graph in order (empty for a graph that was not split)."""
    calls = [n for n in graph.model.graph.nodes if n.op == "call_module" and str(n.target).startswith(STAGE_PREFIX)]
    found = [graph.model.get_submodule(str(n.target)) for n in calls]
    return [m for m in found if isinstance(m, StageRegion)]


@dataclass(frozen=True)
class SplitStagesArgs:
    """stages: how many; balance: the cost balanced ("time": profile latency, "memory": parameters + activations
    kept for backward from liveness, "params": parameter bytes); cuts: cut after these nodes or modules (names
    or module paths, ``stages - 1`` of them) instead of choosing; pinned: module paths no cut may split;
    data: inputs for the run that tells tensors from plain values (default: the example inputs)."""

    stages: int = field(default=2, metadata={"range": (1, 4096)})
    balance: Literal["time", "memory", "params"] = "time"
    cuts: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    data: Any = None


@dataclass(frozen=True)
class SplitStagesInfo(PassInfo):
    """cuts: the node each stage ends with (all but the last); shares: each stage's part of the balanced cost;
    worst_over_ideal: the costliest share times N (1.0 is perfect); sent: names of the tensors crossing each
    cut; sent_bytes: their bytes per cut (from the run); stage_param_bytes: parameter bytes each stage holds;
    candidates: positions where a cut was possible."""

    stages: int
    balance: str
    cuts: tuple[str, ...]
    shares: tuple[float, ...]
    worst_over_ideal: float
    sent: tuple[tuple[str, ...], ...]
    sent_bytes: tuple[int, ...]
    stage_param_bytes: tuple[int, ...]
    candidates: int


def _members(ops: list[fx.Node], path: str) -> list[int]:
    """Indices of the ops belonging to the module at ``path`` (or one of its submodules)."""
    return [i for i, op in enumerate(ops) if any(p == path or p.startswith(f"{path}.") for p in module_paths(op))]


def _requested_position(name: str, ops: list[fx.Node], gm: fx.GraphModule) -> int:
    """The position just after the node or module ``name`` (a cut after it); PassArgsError when it names
    nothing, an input, or a part of one op (a submodule of a module the graph calls as one node)."""
    index = {n.name: i for i, n in enumerate(ops)}
    if name in index:
        return index[name] + 1
    inside = [op for op in ops if op.op == "call_module" and name.startswith(f"{op.target}.")]
    if inside:
        raise PassArgsError(f"{_NAME}: a cut after {name!r} would cut inside op {inside[0].name!r} (module "
                            f"{inside[0].target!r} runs as one node): cut before or after that op instead")
    members = _members(ops, name)
    if not members:
        raise PassArgsError(f"{_NAME}: cut {name!r} names no op and no module of the graph; ops include "
                            f"{[op.name for op in ops[:8]]}")
    return max(members) + 1


def _pinned_spans(ops: list[fx.Node], pinned: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each pinned module's first and last op index (a cut strictly inside the span would split it)."""
    spans = {}
    for path in pinned:
        members = _members(ops, path)
        if not members:
            raise PassArgsError(f"{_NAME}: pinned module {path!r} is called by no op of the graph")
        spans[path] = (min(members), max(members))
    return spans


def _plan(gm: fx.GraphModule, ops: list[fx.Node], kinds: ValueKinds, args: SplitStagesArgs
          ) -> tuple[list[int], list[float], int]:
    """The cut positions (chosen or checked), each op's cost and how many candidates there were."""
    candidates, blocked = candidate_positions(ops, kinds)
    spans = _pinned_spans(ops, args.pinned)
    candidates = [p for p in candidates if not any(a < p <= b for a, b in spans.values())]
    costs = op_costs(gm, ops, args.balance, _NAME)
    if args.cuts:
        if len(args.cuts) != args.stages - 1:
            raise PassArgsError(f"{_NAME}: {len(args.cuts)} cut(s) make {len(args.cuts) + 1} stages, but stages="
                                f"{args.stages}: give stages - 1 cuts")
        cuts = sorted({_requested_position(c, ops, gm) for c in args.cuts})
        for name, p in zip(args.cuts, cuts):
            if p >= len(ops) or p in cuts[:cuts.index(p)]:
                raise PassArgsError(f"{_NAME}: cut {name!r} leaves an empty stage (it is at the end, or repeats "
                                    "another cut)")
            if p in blocked:
                value = blocked[p]
                users = [u.name for u in value.users][:4]
                raise PassArgsError(f"{_NAME}: a cut after {ops[p - 1].name!r} would split op {value.name!r} from "
                                    f"the users that unpack its result {users}: cut before {value.name!r} or after "
                                    "them")
            for path, (a, b) in spans.items():
                if a < p <= b:
                    raise PassArgsError(f"{_NAME}: a cut after {ops[p - 1].name!r} would split pinned module "
                                        f"{path!r} (ops {ops[a].name!r} to {ops[b].name!r})")
        if len(cuts) != len(args.cuts):
            raise PassArgsError(f"{_NAME}: cuts {list(args.cuts)} name the same position twice")
        return cuts, costs, len(candidates)
    if args.stages - 1 > len(candidates):
        raise PassError(f"{_NAME}: {args.stages} stages need {args.stages - 1} cuts, but this graph has only "
                        f"{len(candidates)} place(s) between ops where only tensors cross"
                        f"{' outside the pinned modules' if spans else ''}: ask for at most "
                        f"{len(candidates) + 1} stages")
    return choose_cuts(costs, candidates, args.stages), costs, len(candidates)


def _needs(ops: list[fx.Node], stage_of: dict[fx.Node, int], kinds: ValueKinds, out_node: fx.Node,
           stages: int) -> tuple[list[set[fx.Node]], list[set[fx.Node]]]:
    """Per stage: the values it receives (tensors and inputs made earlier) and the plain values it recomputes."""
    receives: list[set[fx.Node]] = [set() for _ in range(stages + 1)]  # the last entry: the graph's output
    remat: list[set[fx.Node]] = [set() for _ in range(stages + 1)]

    def need(stage: int, value: fx.Node) -> None:
        if value.op == "get_attr" or stage_of.get(value, -1) == stage:
            return
        roots = remat_roots(value, kinds)
        if roots is None:  # unreachable for positions from candidate_positions
            raise PassError(f"{_NAME}: value {value.name!r} holds tensors without being one and cannot cross a cut")
        if roots == [value]:
            receives[stage].add(value)
            return
        remat[stage].add(value)
        for arg in value.all_input_nodes:
            need(stage, arg)

    for op in ops:
        for arg in op.all_input_nodes:
            need(stage_of[op], arg)
    for arg in out_node.all_input_nodes:
        need(stages, arg)
    return receives, remat


def _build_stage(gm: fx.GraphModule, ops: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                 remat: set[fx.Node]) -> StageRegion:
    """A stage over the parent's modules: ``inputs`` in, ``outputs`` out (always a tuple)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in inputs}

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:
            for arg in node.all_input_nodes:
                copy(arg)
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta = {}
        return env[node]

    for node in sorted(remat, key=list(gm.graph.nodes).index):
        copy(node)
    for op in ops:
        copy(op)
    graph.output(tuple(env[n] for n in outputs))
    return build_stage(gm, graph, len(inputs))


@forge_pass("transform", SplitStagesArgs, info=SplitStagesInfo, requires=("metadata",),
            forbids=("pipeline-stages",), ensures=("pipeline-stages",),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0, note="the stages run the same ops in order"))
def split_stages_transform_pass(graph: ForgeGraph, args: SplitStagesArgs) -> tuple[ForgeGraph, SplitStagesInfo]:
    """Choose (or check) the cuts, build one GraphModule per stage and rewrite the graph into their chain."""
    gm = graph.model
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise PassArgsError(f"{_NAME}: no inputs: capture with example_inputs or pass {{'data': ...}}")
    ops = ops_of(gm)
    if not ops:
        raise PassError(f"{_NAME}: the graph has no op to split")
    kinds = value_kinds(gm, flat_inputs(gm, example))
    try:
        cuts, costs, candidates = _plan(gm, ops, kinds, args)
    except ValueError as exc:
        if isinstance(exc, PassArgsError):
            raise
        raise PassError(str(exc)) from None
    bounds = [0, *cuts, len(ops)]
    stage_of = {op: k for k in range(args.stages) for op in ops[bounds[k]:bounds[k + 1]]}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    receives, remat = _needs(ops, stage_of, kinds, out_node, args.stages)
    if remat[args.stages]:
        raise PassError(f"{_NAME}: the graph returns plain values {sorted(n.name for n in remat[args.stages])}; "
                        "stages return tensors only")
    # what crosses cut k (into stage k + 1): values made before it that stage k + 1 or a later one receives
    crossing = []
    for k in range(args.stages):
        later = set().union(*receives[k + 1:])
        crossing.append(sorted((v for v in later if stage_of.get(v, -1) <= k), key=order.__getitem__))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first_in = [n for n in placeholders if n in set().union(*receives)]
    with GraphRewrite(gm) as rw:
        value_of: dict[fx.Node, fx.Node] = {n: n for n in placeholders}
        inputs = first_in
        for k in range(args.stages):
            try:
                stage = _build_stage(gm, ops[bounds[k]:bounds[k + 1]], inputs, crossing[k], remat[k])
            except ValueError as exc:
                made = ", ".join(dict.fromkeys(r.name for r in graph.history)) or "capture"
                raise PassError(f"{_NAME}: {exc} (passes run so far: {made}); split the graph before the pass "
                                "that put it there") from None
            call = rw.call_module(f"{STAGE_PREFIX}{k}", stage, tuple(value_of[n] for n in inputs), before=out_node)
            for i, value in enumerate(crossing[k]):
                value_of[value] = rw.call_function(operator.getitem, (call, i), before=out_node)
            inputs = crossing[k]
        rw.set_args(out_node, fx.map_arg(out_node.args, lambda n: value_of.get(n, n)))
        for node in reversed(list(gm.graph.nodes)):
            if node.op in ("call_module", "call_function", "call_method", "get_attr") and node in order:
                rw.erase(node)
    # recorded, not derived: a stage returns a tuple even of one tensor, which derivation from the results'
    # metadata cannot tell from a bare tensor (its getitem's inputs would be recorded wrongly)
    propagate_graph(gm, example)
    total = sum(costs) or 1.0
    shares = tuple(sum(costs[bounds[k]:bounds[k + 1]]) / total for k in range(args.stages))
    sizes = tuple(sum(kinds.nbytes.get(v, 0) for v in values) for values in crossing[:-1])
    stage_params = tuple(sum(p.numel() * p.element_size() for p in gm.get_submodule(f"{STAGE_PREFIX}{k}").parameters())
                         for k in range(args.stages))
    return graph, SplitStagesInfo(
        stages=args.stages, balance=args.balance, cuts=tuple(ops[p - 1].name for p in cuts), shares=shares,
        worst_over_ideal=max(shares) * args.stages, sent=tuple(tuple(v.name for v in c) for c in crossing[:-1]),
        sent_bytes=sizes, stage_param_bytes=stage_params, candidates=candidates)

