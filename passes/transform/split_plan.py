"""Where a graph can be cut into pipeline stages, what each op costs, and the balanced choice of cuts.

A *cut position* ``p`` lies between the ``p-1``-th and ``p``-th op of the graph (ops: every node but placeholders,
get_attr reads and the output). A position is a candidate when every value crossing it can be sent as a tensor:
a tensor, or a plain value (a size, a dtype) recomputed on the far side from tensors that cross instead. A
value holding tensors that is not one (an op's tuple result before its ``getitem`` users unpack it) cannot
cross: cutting there would split the op from its outputs. Costs per op come from the metadata the analysis
passes wrote (profile: latency; liveness: activation bytes kept for backward) or from the modules' parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ...graph.metadata import get_meta
from ..analysis.liveness import LivenessRecord
from ..analysis.profile import ProfileRecord

__all__ = ["ValueKinds", "candidate_positions", "choose_cuts", "module_paths", "op_costs", "ops_of", "value_kinds"]

_NOT_OPS = ("placeholder", "get_attr", "output")


def ops_of(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's ops in order (what a stage runs; constants and inputs are not ops)."""
    return [n for n in gm.graph.nodes if n.op not in _NOT_OPS]


@dataclass(frozen=True)
class ValueKinds:
    """Per node: its value is one tensor (``tensor``, with its bytes in ``nbytes``) or holds no tensor (``plain``)."""

    tensor: frozenset[fx.Node]
    plain: frozenset[fx.Node]
    nbytes: dict[fx.Node, int]


def value_kinds(gm: fx.GraphModule, flat: list[Any]) -> ValueKinds:
    """Run the graph once (eval, no grad) and classify each node's value; the run is restored to its mode."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            interp.run(*flat)
    finally:
        gm.train(was_training)
    tensor, plain, nbytes = set(), set(), {}
    for node, value in interp.env.items():
        if isinstance(value, torch.Tensor):
            tensor.add(node)
            nbytes[node] = value.numel() * value.element_size()
        elif not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value)):
            plain.add(node)
    return ValueKinds(frozenset(tensor), frozenset(plain), nbytes)


def remat_roots(node: fx.Node, kinds: ValueKinds) -> list[fx.Node] | None:
    """The tensors (and inputs) a plain value is recomputed from on the far side of a cut; None when ``node``
    holds tensors without being one (it cannot cross a cut)."""
    if node in kinds.tensor or node.op == "placeholder":
        return [node]
    if node not in kinds.plain:
        return None
    roots: list[fx.Node] = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            continue
        sub = remat_roots(arg, kinds)
        if sub is None:
            return None
        roots.extend(sub)
    return roots


def candidate_positions(ops: list[fx.Node], kinds: ValueKinds) -> tuple[list[int], dict[int, fx.Node]]:
    """Positions 1..len(ops)-1 where only tensors (or plain values recomputed from tensors) cross, and for each
    refused position the value that cannot cross there."""
    index = {n: i for i, n in enumerate(ops)}
    last_use: dict[fx.Node, int] = {}
    for i, op in enumerate(ops):
        for arg in op.all_input_nodes:
            last_use[arg] = i
    blocked: dict[int, fx.Node] = {}
    for node, last in last_use.items():
        if node.op in ("placeholder", "get_attr") or remat_roots(node, kinds) is not None:
            continue
        for p in range(index[node] + 1, last + 1):  # cutting anywhere between it and its last user
            blocked.setdefault(p, node)
    return [p for p in range(1, len(ops)) if p not in blocked], blocked


def module_paths(node: fx.Node) -> set[str]:
    """The module paths a node belongs to: its call_module target and the export frontend's module stack."""
    paths = {str(node.target)} if node.op == "call_module" else set()
    for value in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(value, tuple) and value and isinstance(value[0], str) and value[0]:
            paths.add(value[0])
    return paths


def _param_bytes(gm: fx.GraphModule, ops: list[fx.Node]) -> list[float]:
    """Bytes of the parameters each op reads (a module's own, or a get_attr'd one), each counted at first use."""
    seen: set[int] = set()
    out = []
    for op in ops:
        params: list[torch.Tensor] = []
        if op.op == "call_module":
            params.extend(gm.get_submodule(str(op.target)).parameters())
        for arg in op.all_input_nodes:
            if arg.op == "get_attr":
                value = gm.get_parameter(str(arg.target)) if _is_param(gm, str(arg.target)) else None
                params.extend([value] if value is not None else [])
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        out.append(float(sum(p.numel() * p.element_size() for p in fresh)))
    return out


def _is_param(gm: nn.Module, path: str) -> bool:
    try:
        gm.get_parameter(path)
    except AttributeError:
        return False
    return True


def op_costs(gm: fx.GraphModule, ops: list[fx.Node], balance: str, pass_name: str) -> list[float]:
    """Each op's cost for ``balance``: "time" (profile latency), "memory" (parameter bytes + activation bytes
    kept for backward, from liveness) or "params" (parameter bytes). ValueError naming the missing analysis."""
    if balance == "params":
        return _param_bytes(gm, ops)
    record: type[ProfileRecord] | type[LivenessRecord] = ProfileRecord if balance == "time" else LivenessRecord
    analysis = "profile_analysis_pass" if balance == "time" else "liveness_analysis_pass"
    found = [get_meta(op).software.get(record) for op in ops]
    missing = [op.name for op, rec in zip(ops, found) if rec is None]
    if missing and (balance == "time" or len(missing) == len(ops)):  # liveness records only nodes making tensors
        raise ValueError(f"{pass_name}: balance={balance!r} reads {analysis}'s metadata, which nodes {missing[:3]} "
                         f"lack: run {analysis} on this graph first (or balance='params')")
    if balance == "time":
        return [float(rec.latency_ms) for rec in found if isinstance(rec, ProfileRecord)]
    kept = []
    for rec in found:
        if not isinstance(rec, LivenessRecord):
            kept.append(0.0)
            continue
        saved = rec.bytes if rec.saved_for_backward else 0
        kept.append(float(saved + sum(o[2] for o in rec.others if o[4])))
    return [k + p for k, p in zip(kept, _param_bytes(gm, ops))]


def choose_cuts(costs: list[float], candidates: list[int], stages: int) -> list[int]:
    """The ``stages - 1`` candidate positions minimising the costliest stage (dynamic programming: the best split
    of each prefix ending at a candidate into k stages; a scan stops once the last stage alone costs more)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = [0, *candidates, len(costs)]  # where stages may end; ends[0] is the empty prefix
    inf = float("inf")
    best = [[prefix[e] if j else inf for j, e in enumerate(ends)]]  # best[k][j]: ops[:ends[j]] in k + 1 stages
    choice: list[list[int]] = [[0] * len(ends)]
    for k in range(1, stages):
        prev, row, pick = best[-1], [inf] * len(ends), [0] * len(ends)
        for j in range(k + 1, len(ends)):
            for i in range(j - 1, k - 1, -1):
                tail = prefix[ends[j]] - prefix[ends[i]]
                if tail >= row[j]:
                    break  # earlier ends only make the last stage costlier
                value = max(prev[i], tail)
                if value < row[j]:
                    row[j], pick[j] = value, i
        best.append(row)
        choice.append(pick)
    cuts, j = [], len(ends) - 1
    for k in range(stages - 1, 0, -1):
        j = choice[k][j]
        cuts.append(ends[j])
    return sorted(cuts)
