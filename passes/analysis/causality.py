"""causality_analysis_pass: does any output position depend on a later input position?

Two independent measurements on the graph's example inputs (or given ones):

* **perturbation**: change the input at position ``t`` (another token id, or noise for float
  inputs) and measure how much every node's output at positions ``< t`` moves; run per node, so the
  report names the node where a leak *starts* (the first node in graph order whose earlier positions
  move), e.g. the pad-to-2N AFNO's irfft;
* **Jacobian**: from the first sequence-shaped float node (e.g. the embeddings) to the outputs,
  ``d out[:, i] / d x[:, j]`` for every ``j > i`` on a short input, relative to the largest allowed
  (``j <= i``) entry — zero for a causal model, float round-off aside.

The verdict is causal when both leaks are within ``tolerance`` relative to the output's scale
(FFT-based causal convolutions leave ~1e-7 of round-off, a real leak is orders larger).

Which axes of a node are time is followed from the input through the graph on symbolic sizes
(:mod:`.time_axes`), so a (B, C, T) tensor is checked along T even when C == T; a node without a time
axis (a flattened batch, an FFT's frequency axis) is not checked.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import MetaRecord, get_meta, has_meta, register_record
from ..base import forge_pass
from ..contract import PassInfo
from ..propagate import flat_inputs
from .time_axes import time_axes

__all__ = ["CausalityArgs", "CausalityInfo", "CausalityRecord", "causality_analysis_pass"]


@register_record("software.causality")
@dataclass
class CausalityRecord(MetaRecord):
    """Largest change of this node's output at positions before a perturbed input position, on its
    ``time_axes`` (every axis indexed by the input's positions, e.g. both axes of attention scores)."""

    leak: float = 0.0
    relative_leak: float = 0.0
    time_axes: tuple[int, ...] = ()


@dataclass(frozen=True)
class CausalityArgs:
    """input: placeholder name of the sequence input (default: the first integer placeholder, else the
    first); seq_dim: its time axis; positions: perturbed positions (default: four spread over the
    sequence); tolerance: allowed leak relative to the output's largest magnitude; jacobian: also run
    the Jacobian check on the first ``jacobian_len`` positions; data: inputs to use instead of the
    graph's example inputs."""

    input: str | None = None
    seq_dim: int = 1
    positions: tuple[int, ...] | None = None
    tolerance: float = 1e-5
    jacobian: bool = True
    jacobian_len: int = 12
    data: Any = None

    def __post_init__(self) -> None:
        if not 0 < self.tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {self.tolerance}")
        if self.jacobian_len < 2:
            raise ValueError(f"jacobian_len must be >= 2, got {self.jacobian_len}")


@dataclass(frozen=True)
class CausalityInfo(PassInfo):
    """Verdict and evidence: leaks are absolute max changes; ``first_leaking_node`` is where it starts."""

    causal: bool
    perturbation_leak: float
    relative_leak: float
    jacobian_leak: float | None
    first_leaking_node: str | None
    leaking_nodes: tuple[str, ...]
    positions: tuple[int, ...]
    input: str
    tolerance: float


class _Tap(fx.Interpreter):
    """Runs the graph keeping every node's output; can substitute one node's value (for the Jacobian)."""

    def __init__(self, gm: fx.GraphModule, keep: bool, override: tuple[fx.Node, torch.Tensor] | None = None) -> None:
        super().__init__(gm)
        self.keep, self.override = keep, override
        self.values: dict[fx.Node, torch.Tensor] = {}
        self.outputs: list[tuple[fx.Node, Any]] = []

    def output(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Keep each output leaf with the node that produced it (same pytree structure, same order)."""
        out_node = next(n for n in self.graph.nodes if n.op == "output")
        self.outputs = list(zip(pytree.tree_leaves(out_node.args), pytree.tree_leaves(args), strict=False))
        return super().output(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        out = self.override[1] if self.override is not None and n is self.override[0] else super().run_node(n)
        if self.keep and isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
            self.values[n] = out.detach()
        return out


def _seq_input(gm: fx.GraphModule, flat: list[Any], name: str | None, seq_dim: int) -> int:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.dim() > seq_dim]
    if name is not None:
        names = [p.name for p in placeholders]
        if name not in names:
            raise ValueError(f"no input {name!r}; inputs: {names}")
        return names.index(name)
    ints = [i for i in tensors if not flat[i].is_floating_point() and not flat[i].is_complex()]
    if not (ints or tensors):
        raise ValueError(f"no input has a sequence dimension {seq_dim}; pass {{'input': name}}")
    return (ints or tensors)[0]


def _perturb(x: torch.Tensor, t: int, seq_dim: int, gen: torch.Generator) -> torch.Tensor:
    y = x.clone()
    idx: list[slice | int] = [slice(None)] * x.dim()
    idx[seq_dim] = t
    if x.is_floating_point():
        y[tuple(idx)] += torch.randn(y[tuple(idx)].shape, generator=gen, dtype=x.dtype)
    else:  # another token already in the input, so the id is in range
        flat = x.reshape(-1)
        pick = flat[torch.randint(0, flat.numel(), y[tuple(idx)].shape, generator=gen)]
        y[tuple(idx)] = torch.where(pick == y[tuple(idx)], flat.max() - (pick == flat.max()).long(), pick)
    return y


def _before(v: torch.Tensor, t: int, axes: tuple[int, ...]) -> torch.Tensor:
    """The value at positions before ``t`` on every time axis."""
    for axis in axes:
        v = v.narrow(axis, 0, t)
    return v


def _jacobian_leak(gm: fx.GraphModule, flat: list[Any], axes: dict[fx.Node, tuple[int, ...]],
                   length: int) -> float | None:
    """max |d out[:, i] / d x[:, j]| over j > i, from the first float node with a time axis (along the
    first time axis of that node and of each output)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    short = list(flat)
    for k, node in enumerate(placeholders):  # every input on the time axis, cut to the first positions
        for axis in axes.get(node, ()):
            short[k] = short[k].narrow(axis, 0, min(length, short[k].shape[axis]))
    tap = _Tap(gm, keep=True)
    with torch.no_grad():
        tap.run(*short)
    src = next((n for n, v in tap.values.items() if v.is_floating_point() and axes.get(n)
                and n.op != "placeholder"), None)
    if src is None:
        return None
    x = tap.values[src].clone().requires_grad_(True)
    src_axis = axes[src][0]
    t_len = x.shape[src_axis]
    run = _Tap(gm, keep=False, override=(src, x))
    with torch.enable_grad():
        run.run(*short)
        outs = [(o, axes[n][0]) for n, o in run.outputs if isinstance(n, fx.Node) and axes.get(n)
                and isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
        if not outs:  # no output keeps the time axis (e.g. a sequence classifier): nothing to check
            return None
        leak = scale = 0.0
        for i in range(t_len - 1):
            total = functools.reduce(operator.add, (o.narrow(axis, i, 1).sum() for o, axis in outs))
            (grad,) = torch.autograd.grad(total, x, retain_graph=True)
            leak = max(leak, float(grad.narrow(src_axis, i + 1, t_len - i - 1).abs().max()))
            scale = max(scale, float(grad.narrow(src_axis, 0, i + 1).abs().max()))
    return leak / scale if scale else leak


@forge_pass("analysis", CausalityArgs, info=CausalityInfo)
def causality_analysis_pass(graph: ForgeGraph, args: CausalityArgs) -> tuple[ForgeGraph, CausalityInfo]:
    """Measure future-to-past dependence per node (perturbation) and end to end (Jacobian)."""
    gm = graph.model
    example = graph.example_inputs if args.data is None else ExampleInputs.coerce(args.data)
    if example is None:
        raise ValueError("no inputs: capture with example_inputs or pass {'data': ...}")
    flat = flat_inputs(gm, example)
    which = _seq_input(gm, flat, args.input, args.seq_dim)
    seq = flat[which]
    length = int(seq.shape[args.seq_dim])
    if length < 3:
        raise ValueError(f"the sequence input has length {length}; causality needs at least 3 positions")
    positions = args.positions or tuple(sorted({max(1, length // 4), length // 2, (3 * length) // 4, length - 1}))
    bad = [p for p in positions if not 1 <= p < length]
    if bad:
        raise ValueError(f"positions {bad} outside [1, {length})")
    name = [n.name for n in gm.graph.nodes if n.op == "placeholder"][which]
    was_training = gm.training
    gm.eval()
    gen = torch.Generator().manual_seed(0)
    try:
        axes = time_axes(gm, flat, which, args.seq_dim, name)
        base = _Tap(gm, keep=True)
        with torch.no_grad():
            out = base.run(*flat)
        scale = max((float(o.abs().max()) for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
                     and o.is_floating_point() and o.numel()), default=1.0) or 1.0
        leaks: dict[fx.Node, float] = {}
        scales = {n: float(v.abs().max()) if v.numel() else 0.0 for n, v in base.values.items()}
        for t in positions:
            moved = list(flat)
            moved[which] = _perturb(seq, t, args.seq_dim, gen)
            tap = _Tap(gm, keep=True)
            with torch.no_grad():
                tap.run(*moved)
            for node, ref in base.values.items():
                new = tap.values.get(node)
                if new is None or new.shape != ref.shape or not axes.get(node) or node.op == "placeholder":
                    continue
                a, b = _before(ref, t, axes[node]), _before(new, t, axes[node])
                diff = (a - b).abs().max() if a.numel() else torch.tensor(0.0)
                leaks[node] = max(leaks.get(node, 0.0), float(diff.real if diff.is_complex() else diff))
        jac = _jacobian_leak(gm, flat, axes, args.jacobian_len) if args.jacobian else None
    finally:
        gm.train(was_training)
    out_nodes = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = {a for a in pytree.tree_leaves(out_nodes[0].args) if isinstance(a, fx.Node)} if out_nodes else set()
    end_leak = max((leaks.get(n, 0.0) for n in outputs), default=0.0)
    limit = args.tolerance * scale
    leaking = [n for n in gm.graph.nodes if leaks.get(n, 0.0) > args.tolerance * (scales.get(n) or 1.0)]
    for node, leak in leaks.items():
        if has_meta(node):
            get_meta(node).software.set(CausalityRecord(leak=leak, relative_leak=leak / (scales.get(node) or 1.0),
                                                        time_axes=axes[node]))
    causal = end_leak <= limit and not leaking and (jac is None or jac <= args.tolerance)
    return graph, CausalityInfo(
        causal=causal, perturbation_leak=end_leak, relative_leak=end_leak / scale, jacobian_leak=jac,
        first_leaking_node=leaking[0].name if leaking else None, leaking_nodes=tuple(n.name for n in leaking),
        positions=tuple(positions), input=name, tolerance=args.tolerance)


def describe(info: CausalityInfo | Mapping[str, Any]) -> str:
    """One line a person reads: the verdict and where a leak starts."""
    if info["causal"]:
        return f"causal: no output depends on a later {info['input']} position (leak {info['relative_leak']:.1e})"
    return (f"NOT causal: earlier outputs move by {info['perturbation_leak']:.3g} when later {info['input']} "
            f"positions change; the leak starts at node {info['first_leaking_node']}")
