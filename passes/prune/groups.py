"""Dependency groups from the FX graph alone (DepGraph's idea, by label propagation).

Every output channel of a Linear in the graph is a *unit*. The graph is run once on its example
inputs with, beside each value, an int64 tensor of the same shape naming the unit each element comes
from (-1: none). Shape ops (view, reshape, transpose, split, cat, ...) are applied to the labels too, so
labels follow channels through head splits. Where two channels must be cut together they are united:
an elementwise op joining two labelled tensors, the q/k/v of one attention head at SDPA (a head is one
class), a Linear reading a labelled input records which of its input columns belong to which unit.
A unit is **pinned** (never removable) when it meets something the shrink could not follow: the
residual stream or a LayerNorm (a tensor without labels that varies along the channel), a reduction,
an indexing op on the channel axis, the graph output, or any op this analysis does not know.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.ir import classify
from ...graph.modules import ScaledDotProductAttention
from ..propagate import flat_inputs
from .modules import PrunedLinear

__all__ = ["DependencyGraph", "analyse_dependencies", "GroupError"]


class GroupError(ValueError):
    """A dependency group cannot be resolved; the message names the node."""


# ops that never mix channels and keep shape: labels pass through from the first tensor argument
_PASS = frozenset({"gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "to", "type", "contiguous", "clone",
                   "float", "half", "neg", "abs", "exp", "identity", "alias", "detach", "hardswish", "hardtanh",
                   "leaky_relu", "elu", "mish", "softplus", "erf", "sqrt", "rsqrt", "square", "pow"})
# shape ops: the same op applied to the labels moves them with the data
_SHAPE = frozenset({"view", "reshape", "transpose", "permute", "flatten", "unsqueeze", "squeeze", "expand",
                    "split", "split_with_sizes", "chunk", "cat", "t", "unflatten", "movedim", "unbind"})
# slices: labels move like a shape op's; a class varying along the sliced axis is pinned (its cut would move
# the slice bounds), checked once every union is known (RoPE's rotate_half slices a head's channels)
_SLICE = frozenset({"slice", "narrow"})
_BINARY = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum"})
_NEUTRAL = frozenset({"getattr", "size", "sym_size", "dim", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
                      "bitwise_not", "arange", "ones", "zeros", "new_ones", "full", "_assert", "sym_constrain_range"})


@dataclass
class DependencyGraph:
    """Result of the analysis: unit classes, who produces / consumes them, pins and attention heads."""

    parent: list[int] = field(default_factory=list)
    units: list[tuple[str, int]] = field(default_factory=list)           # unit id -> (producer path, row)
    unit_of: dict[tuple[str, int], int] = field(default_factory=dict)
    columns: dict[str, dict[int, int]] = field(default_factory=dict)     # consumer path -> column -> unit
    pins: dict[int, str] = field(default_factory=dict)                   # unit -> why (node name + reason)
    heads: dict[str, list[int]] = field(default_factory=dict)            # SDPA node -> unit per head
    labels: dict[str, Any] = field(default_factory=dict)                 # node name -> labels of its value

    # -- union-find
    def find(self, u: int) -> int:
        while self.parent[u] != u:
            self.parent[u] = self.parent[self.parent[u]]
            u = self.parent[u]
        return u

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            if rb in self.pins and ra not in self.pins:
                self.pins[ra] = self.pins[rb]

    def pin(self, units: torch.Tensor | list[int], why: str) -> None:
        ids = units.unique().tolist() if isinstance(units, torch.Tensor) else units
        for u in ids:
            if u >= 0:
                self.pins.setdefault(self.find(int(u)), why)

    def new_unit(self, path: str, row: int) -> int:
        self.parent.append(len(self.parent))
        self.units.append((path, row))
        self.unit_of[(path, row)] = len(self.units) - 1
        return len(self.units) - 1

    # -- queries
    def root(self, path: str, row: int) -> int:
        return self.find(self.unit_of[(path, row)])

    def pinned(self, root: int) -> str | None:
        return self.pins.get(self.find(root))

    def classes(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = defaultdict(list)
        for u in range(len(self.units)):
            out[self.find(u)].append(u)
        return dict(out)

    def head_of(self) -> dict[int, tuple[str, int]]:
        """class root -> (SDPA node, head index) for attention-head classes."""
        return {self.find(u): (node, h) for node, per_head in self.heads.items() for h, u in enumerate(per_head)}

    def producers(self) -> list[str]:
        return sorted({p for p, _ in self.units})


def _first_tensor(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _tracked(lab: Any) -> bool:
    return isinstance(lab, torch.Tensor) and bool((lab >= 0).any())


class _LabelInterpreter(fx.Interpreter):
    """Runs the graph and propagates unit labels next to the values (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, dep: DependencyGraph) -> None:
        super().__init__(gm)
        self.dep = dep
        self.lab: dict[fx.Node, Any] = {}
        self.deferred: list[tuple[str, torch.Tensor, int, str]] = []

    def check_deferred(self) -> None:
        """Pin the classes that vary along an axis where an unprunable operand varies too."""
        for name, out, d, why in self.deferred:
            table = torch.tensor([self.dep.find(u) for u in range(len(self.dep.units))] + [-1])
            roots = table[out]  # -1 indexes the trailing -1
            if bool((roots != roots.select(d, 0).unsqueeze(d)).any()):
                self.dep.pin(out, f"node {name!r}: {why}")

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        try:
            self.lab[n] = self._labels(n, value)
        except GroupError:
            raise
        except Exception as exc:  # noqa: BLE001 - an op the labels cannot follow pins what it touches
            self._pin_inputs(n, f"labels could not follow it ({type(exc).__name__})")
            self.lab[n] = None
        if isinstance(self.lab[n], torch.Tensor):
            self.dep.labels[n.name] = self.lab[n]
        elif isinstance(self.lab[n], tuple | list):
            self.dep.labels[n.name] = tuple(self.lab[n])
        return value

    def _flat(self, a: fx.Node) -> tuple[Any, ...]:
        lab = self.lab.get(a)
        return tuple(lab) if isinstance(lab, tuple | list) else (lab,)

    def _in(self, a: Any) -> Any:
        return self.lab.get(a) if isinstance(a, fx.Node) else None

    def _pin_inputs(self, n: fx.Node, why: str) -> None:
        for a in n.all_input_nodes:
            lab = self.lab.get(a)
            for t in (lab if isinstance(lab, tuple | list) else (lab,)):
                if _tracked(t):
                    self.dep.pin(t, f"node {n.name!r}: {why}")

    def _labels(self, n: fx.Node, value: Any) -> Any:
        if n.op in ("placeholder", "get_attr"):
            return None
        if n.op == "output":
            self._pin_inputs(n, "reaches the graph output")
            return None
        tracked_in = [a for a in n.all_input_nodes if any(_tracked(t) for t in self._flat(a))]
        _, op = classify(n, self.module)
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            if isinstance(module, nn.Linear):
                return self._linear(n, str(n.target), module, value)
            if isinstance(module, ScaledDotProductAttention):
                return self._sdpa(n, value)
            if op in _PASS:
                return self._in(n.args[0])
            if tracked_in:
                self._pin_inputs(n, f"{type(module).__name__} mixes or normalises the channel axis")
            return None
        if not tracked_in:
            return None
        if op == "scaled_dot_product_attention":
            return self._sdpa(n, value)
        if op == "getitem" and isinstance(self._in(n.args[0]), tuple | list):
            return self._in(n.args[0])[n.args[1]]
        if op in _PASS and isinstance(value, torch.Tensor):
            lab = self._in(n.args[0])
            return lab if isinstance(lab, torch.Tensor) and lab.shape == value.shape else self._unknown(n)
        if op in _SHAPE:
            return self._shape(n)
        if op in _SLICE and isinstance(value, torch.Tensor):
            return self._slice(n, value)
        if op in _BINARY and isinstance(value, torch.Tensor):
            return self._binary(n, value)
        if op in _NEUTRAL:
            return None
        return self._unknown(n)

    def _unknown(self, n: fx.Node) -> None:
        self._pin_inputs(n, "an op the dependency analysis does not follow")
        return None

    def _linear(self, n: fx.Node, path: str, module: nn.Linear, value: torch.Tensor) -> torch.Tensor:
        lab = self._in(n.args[0])
        if _tracked(lab):
            cols = lab.reshape(-1, lab.shape[-1])
            first = cols[0]
            mixed = (cols != first).any(dim=0)
            if bool(mixed.any()):
                self.dep.pin(cols[:, mixed], f"node {n.name!r}: columns of {path} mix units across positions")
            self.dep.columns.setdefault(path, {}).update(
                {j: int(u) for j, u in enumerate(first.tolist()) if u >= 0})
        if type(module) not in (nn.Linear, PrunedLinear):
            return torch.full_like(value, -1, dtype=torch.long)  # LoRA / quantized layers are not producers
        ids = [self.dep.unit_of.get((path, r)) for r in range(module.out_features)]
        if ids[0] is None:
            ids = [self.dep.new_unit(path, r) for r in range(module.out_features)]
        return torch.tensor(ids, dtype=torch.long).expand_as(value).clone()

    def _shape(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        lab_args: list[Any] = []  # the op's arguments, tensors (and lists of them) replaced by their labels
        for a, orig in zip(args, n.args):
            if isinstance(orig, fx.Node) and isinstance(a, torch.Tensor):
                lab = self.lab.get(orig)
                lab_args.append(lab if isinstance(lab, torch.Tensor) else torch.full_like(a, -1, dtype=torch.long))
            elif isinstance(orig, list | tuple) and orig and all(isinstance(o, fx.Node) for o in orig):
                lab_args.append([self.lab.get(o) if isinstance(self.lab.get(o), torch.Tensor)
                                 else torch.full_like(v, -1, dtype=torch.long) for o, v in zip(orig, a)])
            else:
                lab_args.append(a)
        if n.op == "call_method":
            return getattr(lab_args[0], str(n.target))(*lab_args[1:], **kwargs)
        if not callable(n.target):  # a call_function node's target is the function it calls
            raise GroupError(f"dependency analysis: node {n.name!r} ({n.op}) has a target {n.target!r} that "
                             "is not callable")
        return n.target(*lab_args, **kwargs)

    def _slice(self, n: fx.Node, value: torch.Tensor) -> Any:
        src = self._in(n.args[0])
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        if not isinstance(src, torch.Tensor) or not isinstance(dim, int):
            return self._unknown(n)
        if tuple(value.shape) != tuple(src.shape):  # a whole-axis slice cuts nothing
            self.deferred.append((n.name, src, dim, f"slices dim {dim}, along which the groups differ"))
        return self._shape(n)

    def _binary(self, n: fx.Node, value: torch.Tensor) -> torch.Tensor:
        out = torch.full(value.shape, -1, dtype=torch.long)
        args, _ = self.fetch_args_kwargs_from_env(n)
        labs = []
        for a, orig in zip(args, n.args):
            if not isinstance(a, torch.Tensor):
                continue
            lab = self._in(orig)
            labs.append((a, lab.expand(value.shape) if isinstance(lab, torch.Tensor) else None))
        tracked = [lab for _, lab in labs if lab is not None]
        for lab in tracked:
            both = (out >= 0) & (lab >= 0)
            if bool(both.any()):
                pairs = torch.stack([out[both], lab[both]], dim=1).unique(dim=0)
                for a, b in pairs.tolist():
                    self.dep.union(a, b)
            out = torch.where(out >= 0, out, lab)
        for a, lab in labs:
            if lab is not None or a.dim() == 0:
                continue
            varying = [d for d in range(value.dim()) if a.dim() - value.dim() + d >= 0
                       and a.shape[a.dim() - value.dim() + d] > 1]
            for d in varying:  # checked once every union is known (a head may unite its channels later)
                self.deferred.append((n.name, out, d, f"meets a tensor that is not prunable along dim {d} "
                                                      "(residual stream, LayerNorm or constant)"))
        return out

    def _sdpa(self, n: fx.Node, value: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._in(a) for a in n.args[:3])
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and _tracked(self._in(mask)):
            self._pin_inputs(n, "the attention mask depends on pruned channels")
        heads: list[int] = []
        n_heads = value.shape[1]
        for h in range(n_heads):
            ids = torch.cat([t[:, h].reshape(-1) for t in (q, k, v) if isinstance(t, torch.Tensor)])
            ids = ids[ids >= 0].unique().tolist()
            for u in ids[1:]:
                self.dep.union(ids[0], u)
            heads.append(ids[0] if ids else -1)
        if len(heads) == n_heads and all(h >= 0 for h in heads):
            self.dep.heads[n.name] = heads
            if mask is not None and isinstance(mask, fx.Node):
                m = self.env[mask]
                if isinstance(m, torch.Tensor) and m.dim() == 4 and m.shape[1] > 1:
                    self.dep.pin(heads, f"node {n.name!r}: the attention mask differs per head")
        if isinstance(v, torch.Tensor):
            return v[..., :1, :].expand(value.shape).clone() if v.shape != value.shape else v.clone()
        return torch.full(value.shape, -1, dtype=torch.long)


def analyse_dependencies(gm: fx.GraphModule, example: Any) -> DependencyGraph:
    """Run the label propagation on ``example`` (the graph's ExampleInputs) and return the groups."""
    if example is None:
        raise GroupError("dependency analysis needs example inputs: capture the graph with example_inputs")
    dep = DependencyGraph()
    was = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            interp = _LabelInterpreter(gm, dep)
            interp.run(*flat_inputs(gm, example))
            interp.check_deferred()
    finally:
        gm.train(was)
    return dep

