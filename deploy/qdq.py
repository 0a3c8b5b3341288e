"""A quantized ForgeGraph as QDQ: integer codes and Quantize/DequantizeLinear that ONNX Runtime runs as integers.

:func:`to_qdq` returns a copy of the graph whose quantized layers compute with ``torch.ops.quantized_decomposed``
quantize/dequantize ops, which ``torch.onnx.export(..., dynamo=True)`` turns into QuantizeLinear/DequantizeLinear:

* ``QuantizedLinear`` -> :class:`QdqLinear`: the weight as int8 (uint8 for asymmetric) codes with a scale per
  tensor or per output channel, dequantized by DequantizeLinear (an int8 initializer in ONNX; <= 4-bit weights
  are int8 codes here, stored as ONNX INT4 / UINT4 at opset 21 once exported: qdq_int4.py); the input quantizer as
  Q -> DQ with its calibrated scale; the bias as its simulated (quantized) float values. ONNX Runtime fuses
  ``DQ(x) -> MatMul <- DQ(W)`` into ``MatMulIntegerToFloat`` (measured with onnxruntime 1.32; with a Q after the
  MatMul it still picks MatMulIntegerToFloat and keeps the output Q -> DQ).
* Quantizers of activations elsewhere (inserted around functions, inside quantized attention or other layers) ->
  Q -> DQ with their static scale. Parameters of LayerNorm / Embedding / Conv layers are folded to their
  simulated float values (exact; those ops run in float). Quantized attention's matmuls (Q/DQ on both operands
  and after) run as QLinearMatMul.

The exported ONNX must go through :func:`dedicate_dq` before it is saved: the exporter's optimizer shares identical
Q -> DQ pairs among readers, which stops ORT's fusion (measured on the tiny BERT: 6 of 14 linears fused without
it, 14 with it). With static shapes ORT may instead fuse MatMul + Add + Q into QGemm, which rounds the float bias to
int32 in units of ``s_x * s_w`` (exact when the bias is a multiple of that, e.g. a fixed-point bias with no more
fraction bits than input + weight; otherwise off by at most half a unit before the output's Q).

Everything is exact up to float rounding: the codes dequantize to the simulated values bit for bit (checked), and
the activation QDQ computes the simulated formula (see qdq_formats.py). What ONNX cannot express exactly is refused
with :class:`DeployError` naming the layer and the format: run-time scales (``dynamic`` ones other than a linear's
8-bit asymmetric per-tensor input, which becomes ONNX's DynamicQuantizeLinear -> MatMulInteger: deploy/qdq_dynamic.py;
uncalibrated ``auto`` fraction widths), minifloat, block_fp / MXINT / MXFP (scales per block), widths above 8,
lowered layers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph
from ..graph.packed import lowered_layer
from ..passes.quantize.attention import QuantizedSDPA
from ..passes.quantize.modules import (
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedEmbedding,
    QuantizedLayerNorm,
    QuantizedLinear,
    _QuantizedLayer,
)
from ..passes.quantize.quantizer import Quantize
from .manifest import DeployError
from .qdq_dynamic import QdqDynamicLinear, is_onnx_dynamic
from .qdq_formats import (
    INTEGER_FORMATS,
    QdqActivation,
    QdqLinear,
    activation_qparams,
    check_integer,
    weight_codes,
)

__all__ = ["QdqGraph", "to_qdq", "output_step", "dedicate_dq", "dedicate_dq_file"]

_FOLDED = (QuantizedLayerNorm, QuantizedEmbedding, QuantizedConv1d, QuantizedConv2d)


@dataclass(frozen=True)
class QdqGraph:
    """The QDQ copy of a graph, what it holds (``description``, e.g. ``"qdq int8 (14 layers)"``, the deploy
    manifest's ``quantization``) and the unit of the deploy check's bound (``output_step``)."""

    graph: ForgeGraph
    description: str
    output_step: float | None  # None: no static activation quantizer (dynamic ones' steps depend on the input)


class QdqSDPA(QuantizedSDPA):
    """QuantizedSDPA whose slots hold QDQ modules (its forward only runs the slots ``quantizers()`` lists)."""

    def quantizers(self) -> dict[str, Quantize]:
        # QdqActivation stands in for Quantize here: the forward only reads .enabled / .observer and calls it
        return cast(dict[str, Quantize], {s: q for s in self._slots()
                                          if isinstance(q := getattr(self, f"{s}_quantizer"), QdqActivation)})

    def _slots(self) -> tuple[str, ...]:
        from ..passes.quantize.attention import SDPA_SLOTS

        return tuple(SDPA_SLOTS)


class _Converter:
    """One walk over a graph copy's modules, parents before children; counts what it converted."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.weight_widths: set[int] = set()
        self.per_channel = False

    def walk(self, module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            new = self.convert(path, child)
            if new is not child:
                setattr(module, name, new)
            if new is child or isinstance(new, QdqSDPA):
                self.walk(child, path)

    def convert(self, path: str, m: nn.Module) -> nn.Module:
        if lowered_layer(m) is not None:
            raise DeployError(f"to_qdq: {path} is a lowered {type(m).__name__} (its kernel's own integer scheme); "
                              "export the simulated graph, before lower_*_transform_pass, as QDQ")
        if type(m) is QuantizedLinear and m.weight_quantizer is not None:
            return self.linear(path, m)
        if type(m) in _FOLDED:
            self.fold(path, m)
            return m
        if isinstance(m, _QuantizedLayer) and type(m) is not QuantizedLinear:
            raise DeployError(f"to_qdq: {path} is a {type(m).__name__}, whose quantizers to_qdq does not know how "
                              "to place (it converts QuantizedLinear/Conv/LayerNorm/Embedding and quantizers)")
        if isinstance(m, QuantizedSDPA):
            m.__class__ = QdqSDPA
            return m
        if isinstance(m, Quantize):
            return self.quantizer(path, m)
        return m

    def quantizer(self, path: str, q: Quantize) -> nn.Module:
        if not q.enabled and q.observer is None:
            return nn.Identity()
        if q.is_param:
            raise DeployError(f"to_qdq: {path} quantizes a parameter outside a quantized layer ({q.spec.format}); "
                              "to_qdq converts parameters of QuantizedLinear/Conv/LayerNorm/Embedding layers only")
        self.counts["activations"] += 1
        return QdqActivation(activation_qparams(path, q))

    def linear(self, path: str, m: QuantizedLinear) -> QdqLinear | QdqDynamicLinear:
        assert m.weight_quantizer is not None
        codes = weight_codes(path, m.weight_quantizer, m.weight.detach())
        with torch.no_grad():
            bias = None if m.bias is None else self.param(path, m.bias_quantizer, m.bias.detach())
        data_out = self.activation(f"{path}.data_out_quantizer", m.data_out_quantizer)
        self.counts["linears"] += 1
        self.weight_widths.add(codes.width)
        self.per_channel |= codes.per_channel
        q_in = m.data_in_quantizer
        if q_in is not None and q_in.enabled and is_onnx_dynamic(q_in):
            self.counts["dynamic"] += 1
            return QdqDynamicLinear(codes, bias, data_out)
        data_in = self.activation(f"{path}.data_in_quantizer", q_in)
        if data_in is None:
            self.counts["weight_only"] += 1
        return QdqLinear(codes, bias, data_in, data_out)

    def activation(self, path: str, q: Quantize | None) -> QdqActivation | None:
        """A layer's input or output quantizer as QDQ (None where it has none or it is disabled)."""
        if q is None:
            return None
        new = self.quantizer(path, q)
        return new if isinstance(new, QdqActivation) else None

    def param(self, path: str, q: Quantize | None, value: torch.Tensor) -> torch.Tensor:
        """A parameter's simulated values (exact in float), refused for non-integer formats."""
        if q is None:
            return value
        check_integer(path, q, max_width=None)
        return q(value).detach()

    def fold(self, path: str, m: nn.Module) -> None:
        """A LayerNorm / Embedding / Conv layer's parameters become their simulated values; its quantizers go."""
        with torch.no_grad():
            for role in ("weight", "bias"):
                value, q = getattr(m, role, None), getattr(m, f"{role}_quantizer", None)
                if value is None or q is None:
                    continue
                source = value.flatten(1) if isinstance(m, QuantizedConv1d | QuantizedConv2d) and role == "weight" \
                    else value
                folded = self.param(f"{path}.{role}_quantizer", q, source.detach()).view_as(value)
                setattr(m, role, nn.Parameter(folded.clone(), requires_grad=False))
                setattr(m, f"{role}_quantizer", None)
                self.counts["folded"] += 1


def to_qdq(mg: ForgeGraph) -> QdqGraph:
    """A QDQ copy of the quantized graph ``mg`` (unchanged); DeployError naming the layer and format for anything
    ONNX QDQ cannot express exactly, or when nothing in ``mg`` is quantized."""
    graph = mg.copy()
    graph.eval()
    conv = _Converter()
    conv.walk(graph.model, "")
    if not conv.counts["linears"] and not conv.counts["activations"]:
        raise DeployError("to_qdq: the graph has no quantized linear layer or activation quantizer to export as "
                          "QDQ; export it as float")
    try:
        step: float | None = output_step(mg)
    except DeployError:
        if not conv.counts["dynamic"]:
            raise
        step = None
    return QdqGraph(graph, _describe(conv), step)


def _describe(conv: _Converter) -> str:
    """``"qdq int8 (14 layers)"``, with the weight widths, their storage (<= 4 bits: ONNX INT4 / UINT4), per-channel
    scales said."""
    widths = sorted(conv.weight_widths)
    name = "int8" if widths in ([8], []) else "w" + "/".join(map(str, widths)) + "a8"
    notes = []
    blocked = conv.counts["weight_only"] or conv.counts["dynamic"]  # see qdq_int4.int4_blocker
    four = "int8 (not INT4: weight-only or dynamic-input layers)" if blocked else "ONNX INT4/UINT4"
    for held, ws in ((four, [w for w in widths if w <= 4]), ("int8", [w for w in widths if 4 < w < 8])):
        if ws:
            notes.append(f"int{'/'.join(map(str, ws))} weights held in {held} initializers")
    if conv.per_channel:
        notes.append("per-channel weight scales")
    if conv.counts["dynamic"]:
        notes.append(f"{conv.counts['dynamic']} with dynamic uint8 inputs (DynamicQuantizeLinear)")
    if conv.counts["weight_only"]:
        notes.append(f"{conv.counts['weight_only']} weight-only (float matmul)")
    if conv.counts["folded"]:
        notes.append(f"{conv.counts['folded']} folded float params")
    extra = "; " + "; ".join(notes) if notes else ""
    return f"qdq {name} ({conv.counts['linears']} layers, {conv.counts['activations']} activation QDQ{extra})"


def output_step(mg: ForgeGraph) -> float:
    """The unit of the deploy check's bound for a quantized graph: the largest step of its static activation
    quantizers (integer / scaled_integer with a fixed or calibrated scale; per channel, the largest channel's).

    Why the largest: a runtime's float ops (GELU, softmax, LayerNorm, the order of a sum) differ from torch's by
    ulps, which can move a value across a rounding boundary of a downstream quantizer: one code, one step of that
    quantizer, which the following layers carry to the output scaled by their weights (|w| < 1 in trained
    transformers). Used for QDQ ONNX and for AOTI packages of the simulated graph. DeployError when the graph has
    no such quantizer (only run-time scales, or weights only)."""
    steps = []
    for q in mg.model.modules():
        if not isinstance(q, Quantize) or q.is_param or not q.enabled or q.spec.format not in INTEGER_FORMATS:
            continue
        if q.fmt.name == "integer" and not q.auto_fixed:
            steps.append(2.0 ** -q.params["frac_width"])
        elif q.calibrated and not q.params.get("dynamic", False):
            steps.append(float(q.scale.max()))
    if not steps:
        raise DeployError("output_step: the graph has no activation quantizer with a static scale (integer or "
                          "calibrated scaled_integer): its outputs have no fixed quantization step to bound a check by")
    return max(steps)



def dedicate_dq(model: Any) -> int:
    """Give every reader of a shared Q -> DQ pair its own pair (in place on an ``onnx.ModelProto``); returns how
    many nodes were added. The exporter's optimizer merges identical pairs and their scale constants (the query,
    key and value layers quantize the same input with the same scale), and ONNX Runtime (1.32) fuses a DQ ->
    MatMul into MatMulIntegerToFloat only when that DQ feeds the one MatMul. A uint8 Q stays shared (its readers
    are the DQ copies): ORT still fuses every MatMul and quantizes the tensor once, not once per reader (MiniLM:
    38 linears fused with 26 Q nodes instead of 38). An int8 Q is copied per DQ too: ORT rewrites int8 Q -> DQ
    pairs to uint8 before fusing, and only a Q with one DQ (tiny BERT: 8 of 14 fused when shared). Copies get
    their own scale and zero-point initializers, else ORT's common-subexpression pass merges them back. A Q that
    re-quantizes a
    DQ's output with the same scale and zero point (a LayerNorm's output quantizer, then a linear's input one) is
    the identity on the codes and is skipped first: ORT removes such pairs itself, after which one Q would feed
    several MatMuls again. Same values computed."""
    import onnx

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    _skip_requantization(graph, inits)
    added = 0

    def readers() -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for node in graph.node:
            for name in node.input:
                out.setdefault(name, []).append(node)
        return out

    def copy_of(node: Any, tag: str) -> Any:
        nonlocal added
        new = type(node)()
        new.CopyFrom(node)
        new.name, new.output[0] = f"{node.name}_{tag}", f"{node.output[0]}_{tag}"
        for j in (1, 2):  # scale, zero point
            if j < len(new.input) and new.input[j] in inits:
                t = graph.initializer.add()
                t.CopyFrom(inits[new.input[j]])
                t.name = new.input[j] = f"{new.input[j]}_{new.name}"  # unique: node names are
        added += 1
        return new

    def repoint(user: Any, old: str, new: str) -> None:
        for j, name in enumerate(user.input):
            if name == old:
                user.input[j] = new

    def int8_q(node: Any) -> bool:  # a QuantizeLinear whose zero point (so its output) is int8
        return node.op_type == "QuantizeLinear" and len(node.input) > 2 and node.input[2] in inits \
            and inits[node.input[2]].data_type == onnx.TensorProto.INT8

    outputs = {o.name for o in graph.output}
    for dedicated in (lambda n: n.op_type == "DequantizeLinear", int8_q):
        users_of = readers()
        nodes = list(graph.node)
        del graph.node[:]
        for node in nodes:
            graph.node.append(node)
            users = users_of.get(node.output[0], []) if dedicated(node) else []
            if node.output[0] in outputs or any(u.op_type != "DequantizeLinear" for u in users if int8_q(node)):
                continue
            for i, user in enumerate(users[1:], start=1):
                new = copy_of(node, f"dedicated_{i}")
                graph.node.append(new)
                repoint(user, node.output[0], new.output[0])
    return added


def dedicate_dq_file(path: str | Path) -> int:
    """:func:`dedicate_dq` on the ONNX file ``path`` (weights inline), rewritten in place; returns the nodes added.
    (``ONNXProgram.model_proto`` is a fresh copy on each access: edit the file the exporter saved.)"""
    import onnx

    model = onnx.load(str(path))
    added = dedicate_dq(model)
    onnx.save(model, str(path))
    return added


_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def _skip_requantization(graph: Any, inits: dict[str, Any]) -> None:
    """Readers of ``Q(DQ(codes))`` read ``codes`` when both use the same per-tensor scale and zero point (the same
    type): ``saturate(round((q - z) s / s) + z) == q`` exactly."""
    from onnx import numpy_helper

    def value(name: str) -> Any:
        return numpy_helper.to_array(inits[name]) if name in inits else None

    def same(a: Any, b: Any) -> bool:
        if len(a.input) < 3 or len(b.input) < 3:  # scalar scales: per tensor (an ``axis`` attribute is moot)
            return False
        pairs = [(value(a.input[j]), value(b.input[j])) for j in (1, 2)]
        return all(x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape == () and x == y
                   for x, y in pairs)

    producer = {node.output[0]: node for node in graph.node if node.output}
    renamed: dict[str, str] = {}
    for node in graph.node:
        source = producer.get(node.input[0]) if node.op_type == "QuantizeLinear" and node.input else None
        if source is not None and source.op_type == "DequantizeLinear" and same(source, node):
            renamed[node.output[0]] = source.input[0]
    outputs = {o.name for o in graph.output}
    renamed = {k: v for k, v in renamed.items() if k not in outputs}
    for node in graph.node:
        for j, name in enumerate(node.input):
            node.input[j] = renamed.get(name, name)
    while True:  # drop the skipped Q nodes, then DQ nodes nothing reads any more
        read = {name for node in graph.node for name in node.input} | outputs
        dead = [n for n in graph.node if n.op_type in _QDQ_OPS and n.output[0] not in read]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)
