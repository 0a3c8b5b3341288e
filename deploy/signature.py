"""The inference program of a ForgeGraph: named tensor inputs (minus ``labels``), flat named outputs (minus
``loss``), dynamic batch / sequence axes where the graph's shape guard allows them, exported by torch.export.

The caller's graph is never changed: a copy is rewritten into a plain GraphModule ``forward(input_ids, ...)``
returning a tuple of tensors. Its shape-guard call is removed (a Python call no runtime could run) and the guard's
checks become torch.export dims instead:

* an ``eq`` check keeps the dimension static;
* an ``expr`` check (arithmetic over sizes) is not carried over: torch.export re-traces the inference program and
  derives (and records) the guards it needs; those reading ``labels`` guarded only the loss. A ``labels`` size
  the program reads (ViT's batch) is read from the input the guard proved the same size;
* a ``range`` check ``(lo, hi)`` becomes ``Dim.AUTO(min=lo, max=hi)``: the artifact accepts exactly what the
  fxforge graph accepts (a sequence proven for ``[2, 64]`` stays ``[2, 64]``; 1 is not added);
* no check on a dimension means the fxforge graph accepts any size there, so the artifact asks for
  ``Dim.AUTO(min=1)``. torch.export records the minimum 1 although, like capture, it traces with sizes >= 2
  (its 0/1 specialisation), so batch 1 is not proven by tracing: export.py checks every dynamic artifact at
  batch 1 (the benchmark's 1x128) as one of its two check shapes.

``Dim.AUTO`` lets torch.export keep static what the program's code fixes; the axes reported dynamic are read
back from the exported program, never assumed from what was asked. So are the outputs' dynamic axes: an output
axis whose size is an input axis's symbol follows that axis (logits' batch follows ``input_ids[0]``) and gets its
label and range (:func:`manifest_axes`, what deploy.json records).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import Dim

from ..graph.forge_graph import ForgeGraph
from ..graph.guards import check_input_shapes
from .manifest import AxisRange, DeployError

__all__ = ["InferenceSignature", "DeployProgram", "inference_signature", "export_program", "manifest_axes",
           "LOSS_OUTPUTS", "TRAINING_INPUTS", "torch_noise_ignored"]

TRAINING_INPUTS = ("labels",)
LOSS_OUTPUTS = ("loss",)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


@dataclass
class InferenceSignature:
    """The rewritten inference copy of a graph: ``module(*inputs in input_names order)`` returns one tensor per
    output name. ``ranges`` holds the guard's proven ``(lo, hi)`` per (input, dim) it constrains and ``fixed`` the
    dims it pins to one size (with the guard's reason)."""

    module: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    example_inputs: dict[str, torch.Tensor]
    ranges: dict[tuple[str, int], tuple[int, int | None]]
    fixed: dict[tuple[str, int], str]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outputs by name on keyword inputs (no autograd)."""
        with torch.no_grad():
            out = self.module(*(inputs[n] for n in self.input_names))
        return dict(zip(self.output_names, out, strict=True))


@dataclass
class DeployProgram:
    """A signature exported by torch.export, and the axes that really are dynamic in it (``{input: {axis:
    label}}``) with the range torch.export recorded for each; ``static`` explains the asked axes kept static.
    ``output_axes`` maps each output's dynamic axes to the input axis they follow (``{"logits": {0:
    ("input_ids", 0)}}``)."""

    program: torch.export.ExportedProgram
    signature: InferenceSignature
    dynamic_axes: dict[str, dict[int, str]]
    axis_ranges: dict[tuple[str, int], tuple[int, int | None]]
    static: tuple[str, ...]
    output_axes: dict[str, dict[int, tuple[str, int]]] = field(default_factory=dict)


@contextmanager
def torch_noise_ignored() -> Iterator[None]:
    """Ignore two warnings torch 2.13 raises inside its own exporters, which no caller can act on (and which are
    errors under ``-W error``): TreeSpec deep copies rebuilding the deprecated LeafSpec (torch.onnx, inductor), and
    torch.utils.mkldnn's import-time ``torch.jit.script_method`` (inductor's first compile). Also quiets torch.onnx's
    registry logging "torchvision is not installed. Skipping torchvision::..." four times per export (fxforge graphs
    hold no torchvision ops)."""
    registry = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry.level
    registry.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
            warnings.filterwarnings("ignore", r".*torch\.jit\.script_method.* is deprecated", DeprecationWarning)
            yield
    finally:
        registry.setLevel(level)


def _output_leaves(gm: fx.GraphModule) -> tuple[fx.Node, list[tuple[str, Any]]]:
    """The output node and its (name, value) leaves: keys of a dict / ModelOutput joined by ``_``
    (``logits``), ``output_<i>`` for plain tensors and tuples."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and getattr(info, "out_spec", None) is not None:
        flat = list(value) if isinstance(value, list | tuple) else [value]
        value = pytree.tree_unflatten(flat, info.out_spec)
    leaves, _ = pytree.tree_flatten_with_path(value, is_leaf=lambda v: isinstance(v, fx.Node) or v is None)
    named: list[tuple[str, Any]] = []
    for i, (path, leaf) in enumerate(leaves):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path]
        keyed = any(hasattr(k, "key") or hasattr(k, "name") for k in path)
        named.append(("_".join(keys) if keyed else f"output_{i}", leaf))
    return out, named


def _guard_checks(gm: fx.GraphModule) -> tuple[list[fx.Node], list[tuple[str, int, str, Any, str]]]:
    """The guard call nodes and their checks, with input indices turned into input names."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is check_input_shapes]
    checks: list[tuple[str, int, str, Any, str]] = []
    for node in nodes:
        names = node.kwargs["names"]
        for index, dim, kind, value, why in node.kwargs["checks"]:
            if kind == "same":
                checks.append((names[index], dim, kind, (names[value[0]], value[1]), why))
            elif kind != "expr":  # arithmetic over sizes: torch.export re-derives what the inference program needs
                checks.append((names[index], dim, kind, value, why))
    return nodes, checks


def _reroute_sizes(gm: fx.GraphModule, node: fx.Node, checks: list[tuple[str, int, str, Any, str]]) -> None:
    """Read the sizes a dropped input provides (``sym_size(labels, 0)``, the batch size capture proved equal to
    ``input_ids``' batch) from an input the guard proved the same size instead."""
    inputs = {str(n.target): n for n in gm.graph.nodes if n.op == "placeholder" and n is not node}
    same: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name, dim, kind, value, _ in checks:
        if kind == "same":
            other = (str(value[0]), int(value[1]))
            same.setdefault((name, dim), []).append(other)
            same.setdefault(other, []).append((name, dim))
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is torch.ops.aten.sym_size.int and user.args[0] is node):
            continue
        axis = user.args[1]
        if not isinstance(axis, int):
            continue
        seen: set[tuple[str, int]] = set()
        stack = [(str(node.target), axis)]
        while stack:
            key = stack.pop()
            if key not in seen:
                seen.add(key)
                stack.extend(same.get(key, []))
        source = next(((n, d) for n, d in sorted(seen) if n in inputs), None)
        if source is None:
            continue
        with gm.graph.inserting_before(user):
            size = gm.graph.call_function(torch.ops.aten.sym_size.int, (inputs[source[0]], source[1]))
        size.meta = dict(user.meta)
        user.replace_all_uses_with(size)
        gm.graph.erase_node(user)


def inference_signature(mg: ForgeGraph) -> InferenceSignature:
    """The inference copy of ``mg`` (see the module docstring); DeployError when ``labels`` feeds anything but
    the loss, an input is not a tensor, or no tensor output is left."""
    gm: fx.GraphModule = mg.copy(share_weights=True).eval().model
    guards, checks = _guard_checks(gm)
    for node in guards:
        gm.graph.erase_node(node)
    out, named = _output_leaves(gm)
    kept = [(name, leaf) for name, leaf in named if isinstance(leaf, fx.Node) and name not in LOSS_OUTPUTS]
    if not kept:
        raise DeployError(f"the graph returns no tensor besides the loss (outputs {[n for n, _ in named]}): nothing "
                          "to deploy")
    dup = {n for n, _ in kept if [m for m, _ in kept].count(n) > 1}
    if dup:
        raise DeployError(f"the graph's outputs {sorted(dup)} have the same flat name; return distinct keys")
    gm.graph.erase_node(out)
    gm.graph.output(tuple(leaf for _, leaf in kept))
    gm.graph._codegen = fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in TRAINING_INPUTS]:
        _reroute_sizes(gm, node, checks)
        if node.users:
            users = ", ".join(u.name for u in node.users)
            raise DeployError(f"input {node.name!r} feeds {users}, not only the loss: an inference artifact takes no "
                              f"{node.name}; capture the graph without it (hf_input_names without {node.name!r})")
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = tuple(str(n.target) for n in placeholders)
    examples = _examples(mg, [n.name for n in placeholders], names)
    ranges: dict[tuple[str, int], tuple[int, int | None]] = {}
    for n, d, kind, v, _ in checks:  # several range checks on one dimension: their intersection
        if kind == "range" and n in names:
            lo, hi = ranges.get((n, d), (0, None))
            ranges[(n, d)] = (max(lo, int(v[0])), v[1] if hi is None else hi if v[1] is None else min(hi, v[1]))
    fixed = {(n, d): why for n, d, kind, _, why in checks if kind == "eq" and n in names}
    return InferenceSignature(gm, names, tuple(name for name, _ in kept), examples, ranges, fixed)


def _examples(mg: ForgeGraph, node_names: list[str], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The capture's example inputs for the kept placeholders (positional args fill placeholders in order)."""
    ex = mg.example_inputs
    if ex is None:
        raise DeployError("the graph has no example inputs to export with; capture it with example_inputs")
    by_name: dict[str, Any] = dict(ex.kwargs)
    for i, value in enumerate(ex.args):
        if i < len(node_names):
            by_name.setdefault(node_names[i], value)
    out: dict[str, torch.Tensor] = {}
    for node_name, name in zip(node_names, names, strict=True):
        value = by_name.get(name, by_name.get(node_name))
        if not isinstance(value, torch.Tensor):
            raise DeployError(f"input {name!r} has no example tensor (got {type(value).__name__}): a deploy artifact "
                              "takes tensors only")
        out[name] = value
    return out


def _token_style(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.dtype in _INT_DTYPES


def export_program(sig: InferenceSignature, dynamic_batch: bool, dynamic_seq: bool) -> DeployProgram:
    """torch.export the signature under ``no_grad`` (not inference_mode: AOTInductor then refuses its
    inference tensors) with the asked axes dynamic where the guard allows; see the module docstring."""
    shapes: list[dict[int, Any] | None] = []
    asked: dict[tuple[str, int], str] = {}
    asked_lo: dict[tuple[str, int], int] = {}
    asked_hi: dict[tuple[str, int], int | None] = {}
    static: list[str] = []
    for name in sig.input_names:
        t = sig.example_inputs[name]
        axes: dict[int, Any] = {}
        wanted = ([(0, "batch")] if dynamic_batch and t.dim() >= 1 else []) + \
                 ([(1, "seq")] if dynamic_seq and _token_style(t) else [])
        for axis, label in wanted:
            if (name, axis) in sig.fixed:
                static.append(f"{name} axis {axis} ({label}) static: {sig.fixed[(name, axis)]}")
                continue
            lo, hi = sig.ranges.get((name, axis), (1, None))
            axes[axis] = Dim.AUTO(min=max(lo, 1), max=hi)
            asked[(name, axis)] = label
            asked_lo[(name, axis)], asked_hi[(name, axis)] = max(lo, 1), hi
        shapes.append(axes or None)
    args = tuple(sig.example_inputs[n] for n in sig.input_names)
    try:
        with torch.no_grad():
            ep = torch.export.export(sig.module, args, dynamic_shapes=tuple(shapes), strict=False)
    except Exception as exc:  # torch.export's own errors name the op or guard it could not trace
        raise DeployError(f"torch.export could not export the inference graph ({type(exc).__name__}: "
                          f"{str(exc)[:800]})") from exc
    dynamic, exported, symbols = _dynamic_axes(ep, sig.input_names, asked)
    # torch.export records its tracing range (>= 2 after 0/1 specialisation) but accepts the asked minimum. Axes
    # sharing one symbol (input_ids' and attention_mask's sequence) take the intersection of what was asked.
    shared: dict[Any, tuple[int, int | None]] = {}
    for key, (_, hi) in exported.items():
        if key in asked:
            lo, up = shared.get(symbols[key], (0, None))
            shared[symbols[key]] = (max(lo, asked_lo[key]), _upper(up, _upper(hi, asked_hi[key])))
    ranges = {key: shared[symbols[key]] for key in exported if key in asked}
    for key, label in asked.items():
        if key not in ranges:
            static.append(f"{key[0]} axis {key[1]} ({label}) static: torch.export specialised it to the example's "
                          f"{sig.example_inputs[key[0]].shape[key[1]]}")
    return DeployProgram(ep, sig, dynamic, ranges, tuple(static), _output_axes(ep, sig, dynamic))


def manifest_axes(program: DeployProgram) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, AxisRange]]]:
    """The manifest's ``dynamic_axes`` and ``axis_ranges``: every dynamic input axis with its range, then every
    output axis that follows one (same label and range, ``follows`` naming the input axis)."""
    labels = {name: dict(axes) for name, axes in program.dynamic_axes.items()}
    ranges: dict[str, dict[int, AxisRange]] = {}
    for (name, axis), (lo, hi) in program.axis_ranges.items():
        if axis in program.dynamic_axes.get(name, {}):
            ranges.setdefault(name, {})[axis] = AxisRange(lo, hi)
    for out, axes in program.output_axes.items():
        for axis, (name, in_axis) in axes.items():
            r = ranges.get(name, {}).get(in_axis)
            if r is None:
                continue
            labels.setdefault(out, {})[axis] = program.dynamic_axes[name][in_axis]
            ranges.setdefault(out, {})[axis] = AxisRange(r.min, r.max, f"{name}[{in_axis}]")
    return labels, ranges


def _output_axes(ep: torch.export.ExportedProgram, sig: InferenceSignature, dynamic: dict[str, dict[int, str]]
                 ) -> dict[str, dict[int, tuple[str, int]]]:
    """Each output's axes whose size is exactly a dynamic input axis's symbol, mapped to that (input, axis); an
    axis of a derived size (``2 * seq``) is left out."""
    user_in = torch.export.graph_signature.InputKind.USER_INPUT
    user_out = torch.export.graph_signature.OutputKind.USER_OUTPUT
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    symbols: dict[Any, tuple[str, int]] = {}
    in_specs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == user_in]
    for name, node_name in zip(sig.input_names, in_specs, strict=True):
        shape = getattr(placeholders[node_name].meta.get("val"), "shape", ())
        for axis in sorted(dynamic.get(name, {})):
            symbols.setdefault(shape[axis].node.expr, (name, axis))
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    produced = {n.name: n for n in out_node.all_input_nodes}
    out_specs = [s.arg.name for s in ep.graph_signature.output_specs if s.kind == user_out]
    axes: dict[str, dict[int, tuple[str, int]]] = {}
    for name, arg in zip(sig.output_names, out_specs, strict=False):
        node = produced.get(arg)
        for axis, size in enumerate(getattr(node.meta.get("val") if node is not None else None, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                axes.setdefault(name, {})[axis] = symbols[size.node.expr]
    return axes


def _upper(a: int | None, b: int | None) -> int | None:
    """The tighter of two upper bounds (None: unbounded)."""
    return b if a is None else a if b is None else min(a, b)


def _bounds(vr: Any) -> tuple[int, int | None]:
    """A sympy value range as (lo, hi or None for unbounded)."""
    if vr is None:
        return 0, None
    lo = int(vr.lower) if vr.lower.is_finite and float(vr.lower) > -math.inf else 0
    hi = int(vr.upper) if vr.upper.is_finite and float(vr.upper) < math.inf else None
    return lo, hi


def _dynamic_axes(ep: torch.export.ExportedProgram, names: tuple[str, ...], asked: dict[tuple[str, int], str]
                  ) -> tuple[dict[str, dict[int, str]], dict[tuple[str, int], tuple[int, int | None]],
                             dict[tuple[str, int], Any]]:
    """The input axes that are symbols in ``ep`` (labelled as asked), the range torch.export recorded and the
    symbol of each."""
    user_kind = torch.export.graph_signature.InputKind.USER_INPUT
    user = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == user_kind]
    by_node = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    dynamic: dict[str, dict[int, str]] = {}
    ranges: dict[tuple[str, int], tuple[int, int | None]] = {}
    symbols: dict[tuple[str, int], Any] = {}
    for name, node_name in zip(names, user, strict=True):
        val = by_node[node_name].meta.get("val")
        for axis, size in enumerate(getattr(val, "shape", ())):
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                continue
            ranges[(name, axis)] = _bounds(ep.range_constraints.get(size.node.expr))
            symbols[(name, axis)] = size.node.expr
            dynamic.setdefault(name, {})[axis] = asked.get((name, axis), f"dim{axis}")
    return dynamic, ranges, symbols
