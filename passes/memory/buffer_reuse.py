"""buffer_reuse_transform_pass: in-place elementwise ops and out= products where liveness proves it safe.

Seed 003's lesson, buffer reuse in hot paths, for inference graphs. One eval run of the graph keeping every
value alive (the liveness analysis's shared helper, passes/analysis/liveness.record_storages) says which values
share a storage (views, eval-mode dropout, tuple pieces) and who reads each storage when. An elementwise op
(buffer_reuse_rules) may then write into an operand when nothing reads that operand's storage after it; the
storage is no graph input, parameter, buffer or constant, nor returned by the graph; and the checkpoint's own
check (graph/stored_writes) cannot suspect it of sharing a stored tensor. A matrix product may write through
``out=`` into a buffer every reader of which ran before it, when that does not raise the estimated peak.

Inference only, decided so: a graph in training mode is refused. The rewritten forward computes the same
values bit for bit in any grad mode (the same kernels on the same inputs); backward through it is not
supported (autograd refuses a backward that needs an overwritten value, with its "modified by an inplace
operation" error). ``out=`` is refused where an operand requires grad, since autograd refuses ``out=`` in grad
mode: freeze the parameters first (freeze_transform_pass) to allow it. The example inputs decide shapes; a
size-1 dimension in both operands is refused, since another shape could broadcast into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.modules import ScaledDotProductAttention
from ...graph.stored_writes import StoredReach
from ...graph.targets import CheckpointError
from ..analysis.liveness import StorageRun, buffer_lifetimes, live_bytes, measured_peak_bytes, record_storages
from ..base import PassError, forge_pass
from ..compiler.purity import PURE_MODULES
from ..contract import NumericalContract, PassInfo
from ..propagate import flat_inputs
from ..rewrite import GraphRewrite
from .buffer_reuse_rules import InPlace, Match, match_node, out_problem, overwrite_problem

__all__ = ["BufferReuseArgs", "BufferReuseInfo", "Refusal", "Reuse", "buffer_reuse_transform_pass"]

NAME = "buffer_reuse_transform_pass"
# Modules that keep no reference to what they return: a value one of them made may be overwritten.
_STATELESS: frozenset[type[nn.Module]] = frozenset({*PURE_MODULES, ScaledDotProductAttention, nn.Dropout})


@dataclass(frozen=True)
class BufferReuseArgs:
    """data: inputs to analyse with (default: the graph's example inputs); in_place / out: which rewrite kinds
    to make; measure: also measure the allocator's inference peak before and after (torch.profiler)."""

    data: Any = None
    in_place: bool = True
    out: bool = True
    measure: bool = False


@dataclass(frozen=True)
class Reuse:
    """One rewrite: the node, its kind ("in_place" or "out"), what it calls now, the node whose buffer it
    writes into, and the bytes it no longer allocates."""

    node: str
    kind: str
    op: str
    into: str
    bytes_saved: int


@dataclass(frozen=True)
class Refusal:
    """A candidate left as it was, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class BufferReuseInfo(PassInfo):
    """rewrites and refused candidates; bytes_saved: allocations avoided (sum over rewrites); estimated inference
    peaks (liveness) before and after; measured ones (allocator) when asked."""

    rewrites: tuple[Reuse, ...]
    refused: tuple[Refusal, ...]
    bytes_saved: int
    peak_before_bytes: int
    peak_after_bytes: int
    measured_before_bytes: int | None = None
    measured_after_bytes: int | None = None


class _Storages:
    """The recorded run's storages under the rewrites made so far: a union-find over storage pointers (a
    rewritten node's result joins the storage it writes into)."""

    def __init__(self, run: StorageRun, gm: fx.GraphModule) -> None:
        self.run = run
        self.gm = gm
        # tensors modules hold outside their parameters and buffers (a leaf module may return one)
        self.held = run.held | {t.untyped_storage().data_ptr() for m in gm.modules() for t in vars(m).values()
                                if isinstance(t, torch.Tensor)}
        self.index = {n: i for i, n in enumerate(run.nodes)}
        self.ptrs = {n: [p for p, _ in run.storages.get(n, []) if p != 0] for n in run.nodes}
        self.size = {p: s for n in run.nodes for p, s in run.storages.get(n, [])}
        self.parent: dict[int, int] = {}

    def find(self, p: int) -> int:
        while self.parent.get(p, p) != p:
            p = self.parent[p]
        return p

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def root(self, node: fx.Node) -> int | None:
        """The storage group of a node's single-storage result (None: no tensor, or several)."""
        ptrs = set(self.ptrs.get(node, []))
        return self.find(ptrs.pop()) if len(ptrs) == 1 else None

    def members(self, root: int) -> list[fx.Node]:
        return [n for n in self.run.nodes if any(self.find(p) == root for p in self.ptrs[n])]

    def why_live(self, root: int, at: fx.Node, strict: bool) -> str | None:
        """Why the group is not free after node ``at`` (``strict``: not read by ``at`` either); None when free."""
        i = self.index[at]
        members = self.members(root)
        for member in members:
            if member.op == "placeholder":
                return f"shares storage with the graph input {member.name!r}"
            if member.op == "get_attr":
                return f"shares storage with the stored tensor {member.target!r}"
            module = self.gm.get_submodule(str(member.target)) if member.op == "call_module" else None
            if module is not None and type(module) not in _STATELESS:
                return f"made by module {member.target!r} ({type(module).__name__}), which may keep a reference to it"
        if any(self.find(p) == root for p in self.held):
            return "shares storage with a parameter, buffer, module attribute or graph input"
        for member in members:
            for user in member.users:
                if user.op == "output":
                    return f"{member.name!r} is returned by the graph"
                if self.index[user] > i or (strict and user is at):
                    return f"{member.name!r} is read later by {user.name!r}" if user is not at else "it is an operand"
        return None

    def peak(self) -> int:
        """The estimated inference peak (bytes) with the groups as they are now (liveness's rule)."""
        steps = len(self.run.nodes)
        lives: dict[int, list[int]] = {}
        for node in self.run.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            last = max((self.index[u] for u in node.users), default=self.index[node])
            dies = steps if self.run.nodes[last].op == "output" else last
            for p in self.ptrs[node]:
                if p in self.run.held:  # liveness counts activations only
                    continue
                r = self.find(p)
                entry = lives.setdefault(r, [self.index[node], dies, self.size[p]])
                entry[0], entry[1] = min(entry[0], self.index[node]), max(entry[1], dies)
        inf = [0] * (steps + 1)
        for born, dies, size in lives.values():
            for k in range(born, min(dies, steps) + 1):
                inf[k] += size
        return max(inf[:steps], default=0)


def _estimate(run: StorageRun) -> int:
    buffers, _ = buffer_lifetimes(run)
    steps = len(run.nodes)
    inf, _ = live_bytes(buffers, steps)
    return max(inf[:steps], default=0)


def _op_name(target: Any) -> str:
    return str(target) if isinstance(target, str) else getattr(target, "__name__", str(target))


def _try_in_place(node: fx.Node, options: tuple[InPlace, ...], st: _Storages, reach: StoredReach,
                  values: dict[fx.Node, Any]) -> tuple[InPlace | None, list[str]]:
    """The first option whose operand may be overwritten, and why the others may not."""
    reasons: list[str] = []
    for opt in options:
        x = opt.operand
        others = [values.get(o) if isinstance(o, fx.Node) else o for o in opt.others]
        root = st.root(x)
        why = "not a single storage" if root is None else st.why_live(root, node, strict=False)
        if why is None:
            why = overwrite_problem(values.get(x), values.get(node), others)
        if why is None and x in reach.reach:
            why = (f"the checkpoint's check (graph/stored_writes) cannot prove it shares no storage with the "
                   f"stored tensor {reach.reach[x]!r}")
        if why is None:
            return opt, reasons
        reasons.append(f"{x.name}: {why}")
    return None, reasons


def _try_out(node: fx.Node, operands: tuple[Any, ...], st: _Storages, reach: StoredReach,
             values: dict[fx.Node, Any]) -> tuple[fx.Node | None, str]:
    """A node whose dead buffer the product may write into (the one freed last before it), or why none."""
    result, ops = values.get(node), [values.get(o) if isinstance(o, fx.Node) else o for o in operands]
    why = out_problem(result, result, ops)  # the node's own checks (grad, contiguity) first
    if why is not None:
        return None, why
    own = st.root(node)
    before = st.peak()
    why = "no dead buffer of the result's shape and dtype"
    for cand in sorted((n for n in st.run.nodes if st.index[n] < st.index[node]), key=lambda n: -st.index[n]):
        root = st.root(cand)
        if root is None or own is None or root == own or out_problem(values.get(cand), result, ops) is not None:
            continue
        if st.why_live(root, node, strict=True) is not None or cand in reach.reach:
            continue
        saved = dict(st.parent)
        st.union(own, root)
        if st.peak() <= before:
            return cand, ""
        st.parent = saved
        why = "reusing a dead buffer would hold it across a higher point of the estimated peak"
    return None, why


@forge_pass("transform", BufferReuseArgs, info=BufferReuseInfo, aliases=("buffer_reuse",),
            contract=NumericalContract("exact", atol=0.0, rtol=0.0,
                                       note="the same kernels write into reused buffers: bit-identical outputs"))
def buffer_reuse_transform_pass(graph: ForgeGraph, args: BufferReuseArgs) -> tuple[ForgeGraph, BufferReuseInfo]:
    """Rewrite elementwise ops in place and products with out= where the liveness run proves no later reader."""
    gm = graph.model
    if gm.training:
        raise PassError(f"{NAME}: the graph is in training mode; the pass rewrites inference graphs only (in-place "
                        "ops break backward): call graph.eval() first, or train the graph without it")
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise PassError(f"{NAME}: no inputs: capture with example_inputs or pass {{'data': ...}}")
    flat = flat_inputs(gm, example)
    run = record_storages(gm, flat)
    st = _Storages(run, gm)
    peak_before = _estimate(run)
    measured_before = measured_peak_bytes(gm, flat, training=False) if args.measure else None
    reach = StoredReach(gm)
    rewrites: list[Reuse] = []
    refused: list[Refusal] = []
    with GraphRewrite(gm) as rw:
        for node in list(gm.graph.nodes):
            match: Match | None = match_node(node, gm) if node.op.startswith("call") else None
            if match is not None and node.users and isinstance(run.values.get(node), torch.Tensor):
                _rewrite(node, match, args, st, reach, run.values, rw, rewrites, refused)
            try:
                reach.add(node)
            except CheckpointError:
                pass  # a write the graph already had: exporting reports it, not this pass
    gm.recompile()
    after = record_storages(gm, flat, grad=False)
    return graph, BufferReuseInfo(
        rewrites=tuple(rewrites), refused=tuple(refused), bytes_saved=sum(r.bytes_saved for r in rewrites),
        peak_before_bytes=peak_before, peak_after_bytes=_estimate(after), measured_before_bytes=measured_before,
        measured_after_bytes=measured_peak_bytes(gm, flat, training=False) if args.measure else None)


def _rewrite(node: fx.Node, match: Match, args: BufferReuseArgs, st: _Storages, reach: StoredReach,
             values: dict[fx.Node, Any], rw: GraphRewrite, rewrites: list[Reuse], refused: list[Refusal]) -> None:
    """Rewrite one candidate node if a buffer may be reused, else record why not."""
    own = st.root(node)
    size = st.size.get(st.ptrs[node][0], 0) if st.ptrs.get(node) else 0
    if match.skip is not None:
        refused.append(Refusal(node.name, match.skip))
    elif match.options and args.in_place:
        opt, reasons = _try_in_place(node, match.options, st, reach, values)
        if opt is None or own is None:
            refused.append(Refusal(node.name, "; ".join(reasons) or "not a single tensor"))
            return
        rw.replace(node, opt.op, opt.target, opt.args, opt.kwargs)
        st.union(own, st.ptrs[opt.operand][0])
        rewrites.append(Reuse(node.name, "in_place", _op_name(opt.target), opt.operand.name, size))
    elif match.out is not None and args.out:
        into, why = _try_out(node, match.out.operands, st, reach, values)
        if into is None:
            refused.append(Refusal(node.name, why))
            return
        op, target, new_args, kwargs = match.out.build(into)
        rw.replace(node, op, target, new_args, kwargs)
        rewrites.append(Reuse(node.name, "out", _op_name(target), into.name, size))
