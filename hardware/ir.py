"""The hardware IR: a fixed-point ForgeGraph as a list of streaming integer layers, or a refusal.

Every value between layers is a vector of signed fixed-point integers ``(width, frac)`` (value =
integer * 2^-frac). Only quantizers round: a Linear's accumulator, a ReLU and an add are exact and
produce a format wide enough for their result; each fixed-point quantizer (a ``Quantize`` node, or the
``data_in`` / ``data_out`` quantizer inside a ``QuantizedLinear``) becomes a ``requant`` layer
(round half to even, saturate), exactly what ``passes/quantize/fixed.fixed_point_quantize`` does. The
graph input is quantized by its first quantizer (the hardware takes those integers). Floating-point,
MX / block, scaled-integer and ``frac_width: "auto"`` formats, attention and any other op are refused,
naming the node and the format.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..graph.forge_graph import ForgeGraph
from ..graph.metadata import get_meta, has_meta
from ..passes.quantize.modules import QuantizedLinear
from ..passes.quantize.quantizer import Quantize
from ..passes.select import Selector, node_identity

__all__ = ["Fixed", "HwLayer", "HwGraph", "UnsupportedForHardware", "build_hw_graph", "MAX_ACC_WIDTH"]

MAX_ACC_WIDTH = 62  # the integer reference computes in int64; wider accumulators are refused


class UnsupportedForHardware(ValueError):
    """The graph holds an op or number format the emitter cannot build exactly (the message names the node)."""


@dataclass(frozen=True)
class Fixed:
    """A signed fixed-point format: ``width`` bits, value = integer * 2^-frac."""

    width: int
    frac: int

    @property
    def qmin(self) -> int:
        return -(1 << (self.width - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.width - 1)) - 1


@dataclass
class HwLayer:
    """One streaming layer: ``kind`` in input/requant/linear/relu/add/argmax, its inputs (layer names),
    the output format and vector length, its parallelism (elements per beat) and kind-specific data."""

    name: str
    kind: str
    inputs: list[str]
    fmt: Fixed
    size: int
    parallelism: int = 1
    source: str = ""  # the fx node it comes from (for messages)
    weight: torch.Tensor | None = None  # linear: int64 (out, in)
    bias: torch.Tensor | None = None  # linear: int64 (out,)
    weight_fmt: Fixed | None = None
    bias_fmt: Fixed | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class HwGraph:
    """Layers in topological order; ``input`` / ``output`` name the first and last layer."""

    layers: dict[str, HwLayer]
    input: str
    output: str

    def layer(self, name: str) -> HwLayer:
        return self.layers[name]

    def users(self, name: str) -> list[str]:
        return [n for n, layer in self.layers.items() if name in layer.inputs]


def _fixed_of(q: Quantize | None, node: str, role: str) -> Fixed | None:
    """The (width, frac) of a fixed-point quantizer; refuse every other format (None: no quantizer)."""
    if q is None:
        return None
    fmt, params = q.spec.format, dict(q.spec.params)
    if fmt != "integer":
        raise UnsupportedForHardware(
            f"node {node}: its {role} format is {fmt!r} ({params}); the Verilog emitter builds only fixed point "
            "('integer' with a numeric frac_width): quantize this node to fixed point (quantize_transform_pass) or "
            "leave it out")
    if not isinstance(params.get("frac_width"), int):
        raise UnsupportedForHardware(
            f"node {node}: its {role} is fixed point with frac_width {params.get('frac_width')!r}; the emitter "
            "needs one fraction width per tensor known at emit time: give a numeric frac_width")
    return Fixed(int(params["width"]), int(params["frac_width"]))


def _quantize_ints(t: torch.Tensor, fmt: Fixed) -> torch.Tensor:
    """The integers ``fixed_point_quantize`` stores for a parameter (same float ops, so the same rounding)."""
    scaled = torch.round(t.detach().float() * 2.0**fmt.frac)
    return torch.clamp(scaled, fmt.qmin, fmt.qmax).to(torch.int64)


def acc_format(in_fmt: Fixed, w_fmt: Fixed, b_fmt: Fixed | None, n_in: int) -> Fixed:
    """The exact format of ``sum_i x_i * w_i (+ b)``: the larger fraction, enough bits for the worst case."""
    frac = in_fmt.frac + w_fmt.frac if b_fmt is None else max(in_fmt.frac + w_fmt.frac, b_fmt.frac)
    prod = (1 << (in_fmt.width - 1)) * (1 << (w_fmt.width - 1)) << (frac - in_fmt.frac - w_fmt.frac)
    bound = n_in * prod + (0 if b_fmt is None else (1 << (b_fmt.width - 1)) << (frac - b_fmt.frac))
    return Fixed(bound.bit_length() + 1, frac)


def add_format(a: Fixed, b: Fixed) -> Fixed:
    """The exact format of ``a + b`` (aligned to the larger fraction, one carry bit)."""
    frac = max(a.frac, b.frac)
    return Fixed(max(a.width + frac - a.frac, b.width + frac - b.frac) + 1, frac)


class _Builder:
    """Walks the fx graph once, turning each node into hardware layers."""

    def __init__(self, graph: ForgeGraph, parallelism: dict[str, int], nodes: Selector | None) -> None:
        self.gm = graph.model
        self.region = _region(self.gm, nodes) if nodes is not None else None
        ex = graph.example_inputs
        tensors = [*getattr(ex, "args", ()), *getattr(ex, "kwargs", {}).values()]
        self.example = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
        self.par = dict(parallelism)
        self.layers: dict[str, HwLayer] = {}
        self.value: dict[str, str] = {}  # fx node name -> layer name holding its value ("" = float graph input)
        self.input_name = ""
        self.input_size = 0

    def _add(self, layer: HwLayer) -> str:
        self.layers[layer.name] = layer
        return layer.name

    def _source(self, arg: Any, node: str) -> str:
        if not isinstance(arg, fx.Node) or arg.name not in self.value:
            raise UnsupportedForHardware(f"node {node}: its input {arg!r} is not a streamed tensor the emitter built")
        return self.value[arg.name]

    def _quantized(self, src: str, q: Fixed | None, name: str, node: str) -> str:
        """``src`` through a quantizer of format ``q`` (the float input takes the format; identity skipped)."""
        if src == "":
            if q is None:
                raise UnsupportedForHardware(f"node {node} takes the float graph input without a fixed-point "
                                             "quantizer: quantize its data_in to fixed point")
            if "input" not in self.layers:
                self._add(HwLayer("input", "input", [], q, self.input_size, self._par("data_in_0", self.input_size),
                                  source=self.input_name))
            elif self.layers["input"].fmt != q:
                raise UnsupportedForHardware(
                    f"node {node} quantizes the graph input to {q}, another consumer to {self.layers['input'].fmt}: "
                    "the hardware takes one input format; give both quantizers the same width and frac_width")
            return "input"
        if q is None or self.layers[src].fmt == q:
            return src
        prev = self.layers[src]
        return self._add(HwLayer(name, "requant", [src], q, prev.size, prev.parallelism, source=node))

    def _par(self, key: str, size: int) -> int:
        p = int(self.par.pop(key, 1))
        if p < 1 or size % p:
            raise UnsupportedForHardware(f"parallelism[{key!r}] = {p} must divide the vector length {size}")
        return p

    def _enter(self, node: fx.Node) -> None:
        """``node`` is the graph input (or the one value entering the selected region): a float stream."""
        if self.input_name:
            raise UnsupportedForHardware(f"graph input {node.name!r}: the emitter streams one input tensor "
                                         f"(already {self.input_name!r}); select a region with one input")
        self.input_name = node.name
        self.input_size = _features(node, self.example if node.op == "placeholder" else None, self.gm)
        self.value[node.name] = ""

    def build(self) -> HwGraph:
        if self.region is not None:
            return self._build_region(self.region)
        out: str | None = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._enter(node)
            elif node.op == "output":
                args = node.args[0]
                if isinstance(args, tuple | list):
                    if len(args) != 1:
                        raise UnsupportedForHardware("the graph returns several tensors; the emitter streams one")
                    args = args[0]
                out = self._source(args, "output")
            elif node.op == "get_attr":
                raise UnsupportedForHardware(f"node {node.name!r}: a constant tensor; only layers are emitted")
            else:
                self.value[node.name] = self._call(node)
        return self._finish(out)

    def _build_region(self, region: list[fx.Node]) -> HwGraph:
        """The selected nodes only: the one value flowing in is the input, the one flowing out the output."""
        inside = {n.name for n in region}
        entering = {a.name: a for n in region for a in n.all_input_nodes if a.name not in inside}
        leaving = [n for n in region if any(u.name not in inside for u in n.users)]
        if len(entering) != 1 or len(leaving) != 1:
            raise UnsupportedForHardware(f"the selected region {sorted(inside)} must take exactly one tensor from "
                                         f"outside (takes {sorted(entering)}) and give exactly one (gives "
                                         f"{[n.name for n in leaving]})")
        self._enter(next(iter(entering.values())))
        for node in region:
            self.value[node.name] = self._call(node)
        return self._finish(self.value[leaving[0].name])

    def _finish(self, out: str | None) -> HwGraph:
        if out is None or out == "":
            raise UnsupportedForHardware("the graph's output is its float input: nothing to emit")
        if not any(layer.kind == "linear" for layer in self.layers.values()):
            raise UnsupportedForHardware("the graph has no Linear layer: nothing to accelerate")
        if self.par:
            raise UnsupportedForHardware(f"parallelism names {sorted(self.par)}, which are not Linear layers of "
                                         f"this graph (nor 'data_in_0'); linear layers: "
                                         f"{[n for n, v in self.layers.items() if v.kind == 'linear']}")
        return HwGraph(self.layers, "input", out)

    def _call(self, node: fx.Node) -> str:
        name, module, op = node_identity(node, self.gm)
        label = f"{node.name!r} ({op})"
        if isinstance(module, Quantize):
            src = self._source(node.args[0], label)
            return self._quantized(src, _fixed_of(module, label, module.role), node.name, label)
        if isinstance(module, QuantizedLinear):
            return self._linear(node, module, label)
        if module is not None and op != "relu":
            quant = getattr(module, "quant", None)
            what = f"{type(module).__name__} quantized as {quant.format!r}" if quant is not None else \
                f"{type(module).__name__}, not quantized to fixed point"
            raise UnsupportedForHardware(f"node {label}: {what}; the emitter builds fixed-point Linear, ReLU, add "
                                         "and argmax only")
        if op == "relu":
            src = self._source(node.args[0], label)
            prev = self.layers[src] if src else None
            if prev is None:
                raise UnsupportedForHardware(f"node {label} takes the float graph input: quantize it first")
            return self._add(HwLayer(node.name, "relu", [src], prev.fmt, prev.size, prev.parallelism, source=label))
        if op == "add" or node.target is operator.add:
            return self._add_node(node, label)
        if op == "argmax":
            return self._argmax(node, label)
        raise UnsupportedForHardware(f"node {label}: op {op!r} has no hardware layer (supported: fixed-point "
                                     "Linear, ReLU, add, argmax; attention, norms and float ops are refused)")

    def _linear(self, node: fx.Node, m: QuantizedLinear, label: str) -> str:
        name = node.name
        src = self._source(node.args[0], label)
        in_fmt = _fixed_of(m.data_in_quantizer, label, "data_in")
        src = self._quantized(src, in_fmt, f"{name}_data_in", label)
        w_fmt = _fixed_of(m.weight_quantizer, label, "weight")
        if w_fmt is None:
            raise UnsupportedForHardware(f"node {label}: its weight is not quantized (float); "
                                         "quantize weight to fixed point")
        b_fmt = _fixed_of(m.bias_quantizer, label, "bias") if m.bias is not None else None
        if m.bias is not None and b_fmt is None:
            raise UnsupportedForHardware(f"node {label}: its bias is not quantized (float); "
                                         "quantize bias to fixed point")
        prev = self.layers[src]
        if prev.size != m.in_features:
            raise UnsupportedForHardware(f"node {label}: input has {prev.size} features, the layer expects "
                                         f"{m.in_features}")
        acc = acc_format(prev.fmt, w_fmt, b_fmt, m.in_features)
        if acc.width > MAX_ACC_WIDTH:
            raise UnsupportedForHardware(f"node {label}: its accumulator needs {acc.width} bits (> {MAX_ACC_WIDTH}); "
                                         "use narrower widths")
        par = self._par(name, m.out_features)
        layer = HwLayer(name, "linear", [src], acc, m.out_features, par, source=label,
                        weight=_quantize_ints(m.weight, w_fmt), weight_fmt=w_fmt,
                        bias=None if m.bias is None or b_fmt is None else _quantize_ints(m.bias, b_fmt),
                        bias_fmt=b_fmt)
        self._add(layer)
        out_fmt = _fixed_of(m.data_out_quantizer, label, "data_out")
        return self._quantized(name, out_fmt, f"{name}_data_out", label)

    def _add_node(self, node: fx.Node, label: str) -> str:
        if len(node.args) != 2 or node.kwargs:
            raise UnsupportedForHardware(f"node {label}: only a + b of two tensors is emitted")
        a, b = (self._source(x, label) for x in node.args)
        if "" in (a, b):
            raise UnsupportedForHardware(f"node {label} adds the float graph input: quantize it first")
        la, lb = self.layers[a], self.layers[b]
        if la.size != lb.size:
            raise UnsupportedForHardware(f"node {label}: operands of {la.size} and {lb.size} elements (no broadcast)")
        if la.parallelism != lb.parallelism:
            raise UnsupportedForHardware(f"node {label}: operands stream {la.parallelism} and {lb.parallelism} "
                                         "elements per beat; give the layers feeding it the same parallelism")
        return self._add(HwLayer(node.name, "add", [a, b], add_format(la.fmt, lb.fmt), la.size, la.parallelism,
                                 source=label))

    def _argmax(self, node: fx.Node, label: str) -> str:
        src = self._source(node.args[0], label)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if src == "" or dim not in (-1, 1) or node.kwargs.get("keepdim"):
            raise UnsupportedForHardware(f"node {label}: only argmax over the last dim of a quantized vector "
                                         "is emitted")
        prev = self.layers[src]
        width = max(1, (prev.size - 1).bit_length()) + 1  # a signed index, like every stream
        return self._add(HwLayer(node.name, "argmax", [src], Fixed(width, 0), 1, 1, source=label))


def _region(gm: fx.GraphModule, nodes: Selector) -> list[fx.Node]:
    """The call nodes ``nodes`` selects, with the quantizer nodes the quantize pass put around them."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    chosen = {n.name for n in calls if nodes.matches(*node_identity(n, gm))}
    if not chosen:
        raise UnsupportedForHardware(f"the node selector {nodes} selects no node of the graph")
    for n in calls:
        module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(module, Quantize) and (any(a.name in chosen for a in n.all_input_nodes)
                                             or any(u.name in chosen for u in n.users)):
            chosen.add(n.name)
    return [n for n in calls if n.name in chosen]


def _features(node: fx.Node, example: torch.Tensor | None, gm: fx.GraphModule) -> int:
    """The last-dim length of the input stream: capture's example value, the node's metadata, the example
    input, or the in_features of a Linear it feeds."""
    val = node.meta.get("val", node.meta.get("example_value"))
    shape = getattr(val, "shape", None)
    if shape is None and has_meta(node):
        res = get_meta(node).common.results.get("data_out_0")
        shape = None if res is None else res.shape
    if shape is None and example is not None:
        shape = tuple(example.shape)
    if shape is None:
        for user in node.users:
            m = gm.get_submodule(str(user.target)) if user.op == "call_module" else None
            if isinstance(m, QuantizedLinear):
                return int(m.in_features)
    if shape is None or len(shape) < 1:
        raise UnsupportedForHardware(f"graph input {node.name!r}: its shape is unknown; capture with example inputs")
    return int(shape[-1])


def build_hw_graph(graph: ForgeGraph, parallelism: dict[str, int] | None = None,
                   nodes: Any = None) -> HwGraph:
    """The hardware layers of a fixed-point quantized graph (UnsupportedForHardware names what is not).

    ``parallelism``: elements per beat, by Linear node name (its output) and ``data_in_0`` (default 1).
    ``nodes``: a selector (passes/select.py) of the region to emit; None: the whole graph.
    """
    selector = None if nodes is None else Selector.parse(nodes)
    return _Builder(graph, parallelism or {}, selector).build()
