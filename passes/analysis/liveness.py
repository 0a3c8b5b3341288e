"""liveness_analysis_pass: each activation's lifetime and the forward's peak activation memory.

Seed 003's lesson: know where memory goes before reusing buffers. From the graph order, each value
is born at its node and dies at its last user; values that share storage (views such as reshape,
permute, slicing — found by running the graph once and comparing storages) live as one buffer. The
inference peak is the largest sum of live buffers at any node. For training, autograd also keeps
what backward needs: the tensors each node saves (recorded with saved-tensor hooks in the same run,
op-internal ones such as attention's logsumexp included) stay alive until the end of the forward.
Parameters, buffers and the graph's inputs are not activations and are not counted. With
``measure=True`` the estimate is compared with the peak the CPU allocator really reached
(torch.profiler's memory events) in the same mode. The training *step* (forward + backward) usually peaks
in backward, where gradients join the saved tensors: ``peak_step_bytes`` models that walk (step_memory.py
says how, and what the measured ``measured_step_bytes`` counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
from .step_memory import (
    allocator_peak,
    backward_live_bytes,
    checkpointed_regions,
    measured_step_bytes,
    region_costs,
)

__all__ = ["LivenessArgs", "LivenessInfo", "LivenessRecord", "StorageRun", "buffer_lifetimes", "live_bytes",
           "liveness_analysis_pass", "measured_peak_bytes", "record_storages"]

@register_record("software.liveness")
@dataclass
class LivenessRecord(MetaRecord):
    """Where the node's result lives: born/dies are node indices; buffer is the storage group it shares;
    others: its further buffers (tuple outputs, op-internal saved tensors) as [born, dies, bytes, buffer, saved],
    so the peaks can be recomputed from the metadata alone (report/memory_timeline.py)."""

    born: int = 0
    dies: int = 0
    bytes: int = 0
    buffer: int = 0
    saved_for_backward: bool = False
    others: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class LivenessArgs:
    """data: inputs instead of the example inputs; measure: also measure the real peak(s) with the
    profiler; top: how many of the largest buffers alive at the peak the info names."""

    data: Any = None
    measure: bool = False
    top: int = 8


@dataclass(frozen=True)
class LivenessInfo(PassInfo):
    """Estimated peaks (bytes), the node at each peak, the largest buffers alive there, measured peaks.
    training: the forward in grad mode (saved tensors kept to its end); step: forward + backward, its node
    the one whose backward (or forward) reaches the peak."""

    peak_inference_bytes: int
    peak_training_bytes: int
    peak_inference_node: str
    peak_training_node: str
    alive_at_peak: tuple[tuple[str, int], ...]
    buffers: int
    measured_inference_bytes: int | None = None
    measured_training_bytes: int | None = None
    peak_step_bytes: int = 0
    peak_step_node: str = ""
    measured_step_bytes: int | None = None


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


class _Runner(fx.Interpreter):
    """One run keeping every value alive (so equal storage pointers really mean views, never a reused
    address), recording each node's result storages and, in grad mode, what autograd saves per node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.storages: dict[fx.Node, list[tuple[int, int]]] = {}
        self.saved: dict[fx.Node, list[tuple[int, int]]] = {}
        self.current: fx.Node | None = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None and not t.is_meta:
            self.saved.setdefault(self.current, []).append(_storage(t))
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        self.storages[n] = [_storage(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                            and not t.is_meta]
        return out


@dataclass
class StorageRun:
    """One eval-mode run keeping every value alive: the graph's nodes in order, each node's value and result
    storages (pointer, bytes), what autograd saved per node (grad runs), and the storages held outside the
    activations (parameters, buffers, inputs). Shared by liveness_analysis_pass and passes/memory."""

    nodes: list[fx.Node]
    values: dict[fx.Node, Any]
    storages: dict[fx.Node, list[tuple[int, int]]]
    saved: dict[fx.Node, list[tuple[int, int]]]
    held: set[int]


def record_storages(gm: fx.GraphModule, flat: list[Any], grad: bool = True) -> StorageRun:
    """Run ``gm`` once in eval mode on ``flat``; with ``grad`` also record what autograd saves per node."""
    runner = _Runner(gm)
    was_training = gm.training
    gm.eval()
    try:
        with torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(runner.pack, lambda t: t):
            runner.run(*flat)
    finally:
        gm.train(was_training)
    held = {t.untyped_storage().data_ptr()
            for t in (*gm.parameters(), *gm.buffers(), *(v for v in flat if isinstance(v, torch.Tensor)))}
    return StorageRun(list(gm.graph.nodes), dict(runner.env), runner.storages, runner.saved, held)


def buffer_lifetimes(run: StorageRun) -> tuple[dict[int, list[Any]], dict[fx.Node, list[int]]]:
    """Each activation buffer by storage pointer as [born, dies, bytes, saved for backward] (node indices;
    dies = len(nodes) for a returned one: views of one storage live as one buffer) and each node's buffers."""
    nodes = run.nodes
    index = {n: i for i, n in enumerate(nodes)}
    buffers: dict[int, list[Any]] = {}
    owner: dict[fx.Node, list[int]] = {}
    for node in nodes:
        for ptr, size in run.storages.get(node, []):
            if ptr in run.held or ptr == 0 or node.op in ("placeholder", "get_attr"):
                continue
            entry = buffers.setdefault(ptr, [index[node], index[node], size, False])
            owner.setdefault(node, []).append(ptr)
            last = max((index[u] for u in node.users), default=index[node])
            entry[1] = max(entry[1], last if nodes[last].op != "output" else len(nodes))
    for node, saved in run.saved.items():  # what autograd keeps for backward, as it really saved it
        for ptr, size in saved:
            if ptr in run.held or ptr == 0:
                continue
            if ptr not in buffers:  # an op-internal tensor (e.g. attention's logsumexp, a dropout mask)
                buffers[ptr] = [index[node], index[node], size, False]
                owner.setdefault(node, []).append(ptr)
            buffers[ptr][3] = True
    return buffers, owner


def live_bytes(buffers: dict[int, list[Any]], steps: int) -> tuple[list[int], list[int]]:
    """Bytes alive at each node index (and one past the end) in inference and in training (saved ones stay)."""
    inf = [0] * (steps + 1)
    train = [0] * (steps + 1)
    for born, dies, size, saved in buffers.values():
        for i in range(born, min(dies, steps) + 1):
            inf[i] += size
        for i in range(born, steps + 1 if saved else min(dies, steps) + 1):
            train[i] += size
    return inf, train


def measured_peak_bytes(gm: fx.GraphModule, flat: list[Any], training: bool) -> int:
    """The CPU allocator's peak during one forward (every allocation and free the profiler records, so buffers
    an op allocates and frees inside itself count too), keeping the result alive."""
    with torch.set_grad_enabled(training):
        peak, _, out = allocator_peak(lambda: gm(*flat))
    del out
    return peak


@forge_pass("analysis", LivenessArgs, info=LivenessInfo, requires=("metadata",))
def liveness_analysis_pass(graph: ForgeGraph, args: LivenessArgs) -> tuple[ForgeGraph, LivenessInfo]:
    """Lifetimes per node (LivenessRecord), estimated inference and training peaks, optionally measured ones."""
    gm = graph.model
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise ValueError("no inputs: capture with example_inputs or pass {'data': ...}")
    flat = flat_inputs(gm, example)
    nodes = list(gm.graph.nodes)
    was_training = gm.training
    gm.eval()
    try:
        run = record_storages(gm, flat)
        regions = checkpointed_regions(gm, nodes, run.saved, run.storages)
        buffers, owner = buffer_lifetimes(run)
        steps = len(nodes)
        inf, train = live_bytes(buffers, steps)
        costs = region_costs(regions, run.values)
        for node, (inside, _, kept) in costs.items():  # a region's body peaks inside its node
            at = nodes.index(node)
            inf[at] += inside
            train[at] += inside
            for j in range(at, steps + 1):  # with grad the checkpoint keeps the RNG state to its backward
                train[j] += kept
        bwd = backward_live_bytes(gm, nodes, run.values, run.storages, buffers, run.saved, costs)
        peak_b = max(range(steps), key=lambda i: bwd[i])
        peak_i = max(range(steps), key=lambda i: inf[i])
        peak_t = max(range(steps + 1), key=lambda i: train[i])
        alive = sorted(((n.name, sum(buffers[p][2] for p in owner[n]))
                        for n in owner if any(buffers[p][0] <= peak_i <= buffers[p][1] for p in owner[n])),
                       key=lambda r: -r[1])
        ids = {ptr: i for i, ptr in enumerate(buffers)}
        for node, ptrs in owner.items():
            b = buffers[ptrs[0]]
            others = [[buffers[p][0], min(buffers[p][1], steps - 1), buffers[p][2], ids[p], int(buffers[p][3])]
                      for p in dict.fromkeys(ptrs[1:]) if p != ptrs[0]]
            get_meta(node).software.set(LivenessRecord(born=b[0], dies=min(b[1], steps - 1), bytes=b[2],
                                                       buffer=ids[ptrs[0]], saved_for_backward=b[3], others=others))
        measured: dict[str, int | None] = {"inference": None, "training": None, "step": None}
        if args.measure:
            measured["inference"] = measured_peak_bytes(gm, flat, training=False)
            measured["training"] = measured_peak_bytes(gm, flat, training=True)
            measured["step"] = measured_step_bytes(gm, flat)
    finally:
        gm.train(was_training)
    return graph, LivenessInfo(
        peak_inference_bytes=inf[peak_i], peak_training_bytes=train[peak_t], peak_inference_node=nodes[peak_i].name,
        peak_training_node=nodes[min(peak_t, steps - 1)].name, alive_at_peak=tuple(alive[: args.top]),
        buffers=len(buffers), measured_inference_bytes=measured["inference"],
        measured_training_bytes=measured["training"], peak_step_bytes=max(train[peak_t], bwd[peak_b]),
        peak_step_node=nodes[peak_b].name if bwd[peak_b] > train[peak_t] else nodes[min(peak_t, steps - 1)].name,
        measured_step_bytes=measured["step"])

