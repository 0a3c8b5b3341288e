"""profile_analysis_pass: where a forward spends its time, FLOPs and bytes, node by node.

The graph runs under torch.fx's Interpreter: each node is timed over a few runs (median), counted by
``torch.utils.flop_counter.FlopCounterMode`` in one more run, and sized (its module's parameter bytes,
its result's activation bytes). Figures go into each node's typed software metadata
(:class:`ProfileRecord`), so search objectives and reports read them without measuring again; the
info holds the totals and the nodes sorted by cost.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import MetaRecord, get_meta, register_record
from ..base import forge_pass
from ..contract import PassInfo
from ..propagate import flat_inputs
from .table import format_table

__all__ = ["ProfileArgs", "ProfileInfo", "ProfileRecord", "profile_analysis_pass", "tensor_bytes"]


@register_record("software.profile")
@dataclass
class ProfileRecord(MetaRecord):
    """Median latency (ms), FLOPs, parameter and activation (result) bytes of one node."""

    latency_ms: float = 0.0
    flops: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0


@dataclass(frozen=True)
class ProfileArgs:
    """runs: timed runs (median per node, after one warm-up); data: inputs instead of the example inputs;
    top: how many of the costliest nodes the info lists; print_table: print them."""

    runs: int = 5
    data: Any = None
    top: int = 15
    print_table: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.runs <= 1000:
            raise ValueError(f"runs must be in [1, 1000], got {self.runs}")
        if self.top < 1:
            raise ValueError(f"top must be >= 1, got {self.top}")


@dataclass(frozen=True)
class ProfileInfo(PassInfo):
    """Totals over the graph and the costliest nodes (by latency) as rows."""

    latency_ms: float
    flops: int
    param_bytes: int
    activation_bytes: int
    forward_ms: float
    rows: tuple[dict[str, Any], ...]

    def table(self) -> str:
        return format_table(list(self.rows), ["node", "op", "latency_ms", "share", "mflops", "param_kb", "act_kb"])


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) value."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _Timer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.times: dict[fx.Node, list[float]] = {}
        self.sizes: dict[fx.Node, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        start = time.perf_counter()
        out = super().run_node(n)
        self.times.setdefault(n, []).append((time.perf_counter() - start) * 1e3)
        self.sizes[n] = tensor_bytes(out) if n.op not in ("placeholder", "get_attr", "output") else 0
        return out


class FlopsPerNode(fx.Interpreter):
    """An interpreter recording each node's FLOPs (``flops``) from a running FlopCounterMode (``mode``); mix it in
    before another interpreter class to count FLOPs in that interpreter's run too."""

    mode: Any  # a torch.utils.flop_counter.FlopCounterMode (imported where used: it imports triton)
    flops: dict[fx.Node, int]

    def run_node(self, n: fx.Node) -> Any:
        before = self.mode.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = self.mode.get_total_flops() - before
        return out


class _Flops(FlopsPerNode):
    def __init__(self, gm: fx.GraphModule, mode: Any) -> None:  # a FlopCounterMode
        super().__init__(gm)
        self.mode = mode
        self.flops = {}


def _param_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return sum(p.numel() * p.element_size() for p in mod.parameters()) + \
            sum(b.numel() * b.element_size() for b in mod.buffers())
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return tensor_bytes(obj)
    return 0


@forge_pass("analysis", ProfileArgs, info=ProfileInfo, requires=("metadata",))
def profile_analysis_pass(graph: ForgeGraph, args: ProfileArgs) -> tuple[ForgeGraph, ProfileInfo]:
    """Measure per-node latency, FLOPs and bytes; write ProfileRecords; totals and costliest nodes in info."""
    gm = graph.model
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise ValueError("no inputs: capture with example_inputs or pass {'data': ...}")
    flat = flat_inputs(gm, example)
    was_training = gm.training
    gm.eval()
    timer = _Timer(gm)
    forward: list[float] = []
    try:
        with torch.no_grad():
            gm(*flat)  # warm-up (allocator, lazy init)
            for _ in range(args.runs):
                start = time.perf_counter()
                gm(*flat)
                forward.append((time.perf_counter() - start) * 1e3)
            for _ in range(args.runs):
                timer.run(*flat)
            # imported here: torch.utils.flop_counter imports triton (~0.5 s), which must not happen at
            # `import fxforge` (TRITON_INTERPRET has to be set before triton is first imported)
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as mode:
                counter = _Flops(gm, mode)
                counter.run(*flat)
    finally:
        gm.train(was_training)
    rows, totals = [], {"latency_ms": 0.0, "flops": 0, "param_bytes": 0, "activation_bytes": 0}
    for node in gm.graph.nodes:
        rec = ProfileRecord(latency_ms=statistics.median(timer.times.get(node, [0.0])),
                            flops=int(counter.flops.get(node, 0)), param_bytes=_param_bytes(gm, node),
                            activation_bytes=timer.sizes.get(node, 0))
        get_meta(node).software.set(rec)
        for key in totals:
            totals[key] += getattr(rec, key)
        rows.append((node, rec))
    rows.sort(key=lambda r: -r[1].latency_ms)
    total_ms = totals["latency_ms"] or 1.0
    table = tuple({"node": n.name, "op": get_meta(n).common.op, "latency_ms": round(r.latency_ms, 4),
                   "share": f"{100 * r.latency_ms / total_ms:.1f}%", "mflops": round(r.flops / 1e6, 3),
                   "param_kb": round(r.param_bytes / 1024, 1), "act_kb": round(r.activation_bytes / 1024, 1)}
                  for n, r in rows[: args.top])
    info = ProfileInfo(latency_ms=totals["latency_ms"], flops=int(totals["flops"]),
                       param_bytes=int(totals["param_bytes"]), activation_bytes=int(totals["activation_bytes"]),
                       forward_ms=statistics.median(forward), rows=table)
    if args.print_table:
        print(info.table())
        print(f"total {info.latency_ms:.2f} ms in nodes (forward {info.forward_ms:.2f} ms), "
              f"{info.flops / 1e9:.3f} GFLOPs, params {info.param_bytes / 2**20:.1f} MiB")
    return graph, info
