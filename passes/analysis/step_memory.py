"""A training step's activation memory: estimated through backward, and measured from the allocator.

Both sides of the comparison are one *step*: the forward, then backward of the sum of the graph's
floating outputs (the loss, when the graph returns one with its logits, counts as one of them), with
every weight's ``.grad`` allocated and zeroed beforehand. The measured figure (:func:`measured_step_bytes`)
is the CPU allocator's peak above its level at the step's start, from torch.profiler's per-allocation
memory events (:func:`allocator_peak`): parameters, grads, inputs are held before and not counted; the
saved activations, forward temporaries, activation and weight gradient buffers and recomputation are.

Estimate: the forward's liveness (``liveness.buffer_lifetimes``) says what autograd keeps; the training peak is
often reached in backward, where the saved tensors are still alive and gradients pile up. This model
walks the nodes in reverse (autograd's order for a graph in program order). At node i's backward:

- saved buffers: alive until the backward of the *first* forward node that saved them (the last one to
  run backward releases its reference);
- activation gradients: the gradient of value v is created by the backward of v's last user that needs
  a gradient and lives until v's own backward consumes it; each node's backward also creates its inputs'
  gradients at once (one new buffer per input, the input's size; none for a single-output view such as
  reshape / permute, whose input gradient is a view of its own; a multi-output view such as split
  concatenates, so it counts);
- weight gradients: computed into a new buffer and then added into the existing ``.grad`` (grads are
  assumed allocated before the step, as in a training loop that zeroes rather than frees them).

Checkpointed regions (a call_module running ``torch.utils.checkpoint``, e.g. the activation checkpoint
pass's CheckpointRegion): autograd saves nothing inside, but the region keeps its inputs and the CPU RNG
state (5 KB, to replay dropout) until its backward; its body's own peak is a transient at that node in
forward, and in backward the body is recomputed and differentiated: the body's own step peak (estimated the
same way) or its input gradients, whichever is larger.

Not modelled: workspaces inside an op's backward kernel, the seed gradient (an expanded scalar for a
summed or mean loss) and outputs that are not saved (freed before backward starts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["allocator_peak", "backward_live_bytes", "checkpointed_regions", "measured_step_bytes", "output_loss",
           "region_costs"]


def _grad_bytes(value: Any) -> int:
    """Bytes of the gradient of a node's value: its floating tensors that require grad."""
    return sum(t.nbytes for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_meta)


def _param_grad_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    """Bytes of the weight gradients node's backward computes (a call_module's or a get_attr input's)."""
    params: list[torch.Tensor] = []
    if node.op == "call_module":
        params += list(gm.get_submodule(str(node.target)).parameters())
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            try:
                value = gm.get_parameter(str(arg.target))
            except AttributeError:
                continue
            params.append(value)
    return sum(p.nbytes for p in dict.fromkeys(params) if p.requires_grad)


def checkpointed_regions(gm: fx.GraphModule, nodes: list[fx.Node], saved: dict[fx.Node, list[tuple[int, int]]],
                         storages: dict[fx.Node, list[tuple[int, int]]]) -> dict[fx.Node, Any]:
    """The nodes calling a checkpointed region, each with its module; their inputs are recorded in ``saved``
    as saved by that node (the checkpoint keeps them for the recomputation)."""
    try:
        from ..memory.checkpoint_region import CheckpointRegion
    except ImportError:  # no memory passes: no regions
        return {}
    regions = {n: gm.get_submodule(str(n.target)) for n in nodes if n.op == "call_module"
               and isinstance(gm.get_submodule(str(n.target)), CheckpointRegion)}
    for node in regions:
        saved.setdefault(node, []).extend(s for a in node.all_input_nodes for s in storages.get(a, []))
    return regions


def region_costs(regions: dict[fx.Node, Any], values: dict[fx.Node, Any]) -> dict[fx.Node, tuple[int, int, int]]:
    """Per region node: (forward transient beyond its outputs, backward bytes of recomputing and differentiating
    its body, bytes kept from its forward to its backward besides its inputs: the CPU RNG state, with grad
    only, and a selective region's kept results), from the body's own liveness on the inputs it received."""
    from ..memory.checkpoint_region import KeptStorages, kept_ops
    from .liveness import buffer_lifetimes, live_bytes, record_storages  # liveness imports this module

    out: dict[fx.Node, tuple[int, int, int]] = {}
    rng_state = torch.get_rng_state().nbytes
    for node, region in regions.items():
        body = region.body()
        body.eval()  # record_storages restores this mode on the children, which the outer graph shares
        flat = [values[a] if isinstance(a, fx.Node) else a for a in node.args[: region.inputs]]
        kept = KeptStorages(kept_ops(region.selective))  # a selective region keeps its policy's results too
        with kept if region.selective else contextlib.nullcontext():
            run = record_storages(body, flat)
        buffers, _ = buffer_lifetimes(run)
        inf, train = live_bytes(buffers, len(run.nodes))
        bwd = backward_live_bytes(body, run.nodes, run.values, run.storages, buffers, run.saved)
        outputs = sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(values.get(node))
                      if isinstance(t, torch.Tensor))
        returned = {ptr for ptr, _ in run.storages.get(run.nodes[-1], [])}  # live anyway, not kept besides
        kept_bytes = sum(size for ptr, size in kept.storages.items() if ptr not in returned)
        out[node] = (max(0, max(inf) - outputs), max(max(train), max(bwd, default=0)), rng_state + kept_bytes)
    return out


def backward_live_bytes(gm: fx.GraphModule, nodes: list[fx.Node], values: dict[fx.Node, Any],
                        storages: dict[fx.Node, list[tuple[int, int]]],
                        buffers: dict[int, list[Any]], saved: dict[fx.Node, list[tuple[int, int]]],
                        regions: dict[fx.Node, tuple[int, int, int]] | None = None) -> list[int]:
    """Estimated live bytes at each node's backward (index = forward node index; 0 where none runs).

    ``values`` / ``storages`` / ``saved`` come from one grad-mode run keeping every value (a liveness
    run); ``buffers`` are the activation buffers ``ptr -> [born, dies, bytes, saved]`` of that run;
    ``regions``: region_costs of its checkpointed regions (their backward recomputes the body).
    """
    regions = regions or {}
    steps = len(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    first_saver: dict[int, int] = {}
    for node, ptrs in saved.items():
        for ptr, _ in ptrs:
            if ptr in buffers:
                first_saver[ptr] = min(first_saver.get(ptr, steps), index[node])
    grad = {n: _grad_bytes(values.get(n)) if n.op not in ("placeholder", "get_attr", "output") else 0
            for n in nodes}
    delta = [0] * (steps + 2)  # difference array over node indices: bytes alive during that backward step

    def add(lo: int, hi: int, size: int) -> None:  # alive during steps lo..hi inclusive
        if size and lo <= hi:
            delta[lo] += size
            delta[hi + 1] -= size

    for ptr, first in first_saver.items():
        add(first, steps - 1, buffers[ptr][2])
    for node, (_, _, kept) in regions.items():
        add(index[node], steps - 1, kept)
    new = [0] * steps
    for i, node in enumerate(nodes):
        if not grad[node]:
            continue
        users = [index[u] for u in node.users if u.op != "output" and grad[u]]
        if users:  # created (as a transient, counted in `new` below) at the last user's step, then kept
            add(i, max(users) - 1, grad[node])
        own = {p for p, _ in storages.get(node, [])}
        outputs = [t for t in pytree.tree_leaves(values.get(node)) if isinstance(t, torch.Tensor)]
        for arg in dict.fromkeys(node.all_input_nodes):
            if not grad.get(arg):
                continue
            is_view = len(outputs) == 1 and bool(own) and own <= {p for p, _ in storages.get(arg, [])}
            new[i] += 0 if is_view else grad[arg]
        # a region's input gradients appear as its body's backward ends, when the body's buffers are gone
        new[i] = max(new[i], regions[node][1]) if node in regions else new[i] + _param_grad_bytes(gm, node)
    level = 0
    out = [0] * steps
    for i in range(steps):
        level += delta[i]
        out[i] = level + new[i] if grad[nodes[i]] else 0
    return out


def allocator_peak(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """Run ``fn()`` once under the profiler: (peak bytes above the start level, bytes still held at the end,
    fn's result). Each allocation and free is one ``[memory]`` event; summed in time order they also catch
    buffers an op allocates and frees inside itself (workspaces), which per-op net usages hide."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    if prof.profiler is None or prof.profiler.kineto_results is None:
        raise RuntimeError("allocator_peak: the profiler returned no results")
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak, level, out


def output_loss(out: Any) -> torch.Tensor:
    """The step's scalar: the sum of the graph's floating outputs that require grad."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("no output requires grad: nothing to train (are all parameters frozen?)")
    return torch.stack([t.sum() for t in leaves]).sum()


def measured_step_bytes(gm: fx.GraphModule, flat: list[Any]) -> int:
    """The allocator's peak over one step (forward + backward of :func:`output_loss`) above the level at its
    start, with every trainable weight's ``.grad`` allocated and zeroed first; the grads are restored after."""
    params = [p for p in gm.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        with torch.enable_grad():
            peak, _, _ = allocator_peak(lambda: output_loss(gm(*flat)).backward())
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    return peak
