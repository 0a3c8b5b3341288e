"""Real ONNX INT4/UINT4 weight initializers in a QDQ file: ``store_int4`` rewrites an exported QDQ ModelProto.

torch.onnx's dynamo exporter writes QDQ at opset 20 or below, whose DequantizeLinear has no 4-bit type, so
:func:`~fxforge.deploy.qdq.to_qdq` exports <= 4-bit weights as int8/uint8 codes holding 4-bit values. This
module stores those codes as INT4 (signed) / UINT4 (asymmetric) initializers, packed two per byte as the ONNX
spec says (element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one: ``numpy_helper.from_array``
on an ``ml_dtypes`` int4 array), each DequantizeLinear reading them given its own zero point of the same type,
and raises the default opset to 21 (the first whose Q/DQ take 4-bit types) after checking that every node means
the same at 21. The codes, scales and zero points keep their values: the dequantized weights are bit for bit
those of the int8 file.

ONNX Runtime 1.32 at opset >= 21 cannot load a file whose int8 Q -> DQ pair it propagates over a Reshape /
Unsqueeze / Transpose (its QDQ propagation gives the inserted Q an ``output_dtype`` of int8, then its S8->U8
rewrite turns the zero point to uint8: "output_dtype INT8 does not match y_zero_point type UINT8"). So activation
Q -> DQ pairs become uint8 with zero point + 128, the rewrite ORT makes itself at opset 20: same values. ORT runs
INT4 DQ -> MatMul as a float MatMul on weights dequantized at run time (no integer kernel: MatMulIntegerToFloat
takes 8-bit weights); int8 weights of a mixed graph still fuse. A graph with weight-only layers keeps int8
storage (``int4_blocker``): at opset 21 ORT fuses their float-input DQ -> MatMul into MatMulNBits, which quantizes
the input to int8 at its default accuracy level (measured: 2.5276 for 2.5), and ``store_int4_file`` refuses any
file where ORT does that.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .manifest import DeployError

__all__ = ["INT4_OPSET", "int4_blocker", "int4_weights", "store_int4", "store_int4_file"]

INT4_OPSET = 21  # the first opset whose QuantizeLinear / DequantizeLinear accept INT4 / UINT4
_IR_VERSION = 10  # the first IR version with INT4 / UINT4 (opset 21's)
# ops whose newer definitions (up to opset 21) only add types or attributes whose defaults keep the old meaning
_SAME_MEANING = frozenset({
    "AveragePool", "Cast", "CastLike", "Constant", "ConstantOfShape", "DequantizeLinear", "Equal", "Flatten",
    "Identity", "If", "IsInf", "IsNaN", "Loop", "Pad", "QLinearMatMul", "QuantizeLinear", "ReduceMax", "ReduceMin",
    "Reshape", "Resize", "Scan", "Shape", "Size", "Squeeze", "Transpose", "Unsqueeze"})


def int4_blocker(model: nn.Module) -> str | None:
    """Why a :func:`to_qdq` graph's <= 4-bit weights stay in int8 initializers (None: they can be INT4): a
    weight-only QdqLinear (float input), which ORT 1.32 at opset 21 runs as MatMulNBits, quantizing that input to
    int8 (not the simulated math), or weight codes read by another integer kernel (8-bit only, e.g. MatMulInteger)."""
    from .qdq_formats import QdqLinear

    for name, m in model.named_modules():
        if isinstance(m, QdqLinear) and m.data_in is None:
            return f"{name} is weight-only, and ONNX Runtime runs such layers as MatMulNBits at opset 21"
        if not isinstance(m, QdqLinear) and isinstance(getattr(m, "codes", None), torch.Tensor):
            return f"{name} ({type(m).__name__}) reads its weight codes with an 8-bit integer kernel"
    return None


def int4_weights(model: nn.Module) -> dict[str, bool]:
    """``{codes buffer name: signed}`` of the <= 4-bit QdqLinear weights of a :func:`to_qdq` graph's model, to
    store as INT4 / UINT4; empty when :func:`int4_blocker` gives a reason."""
    from .qdq_formats import QdqLinear

    if int4_blocker(model) is not None:
        return {}
    return {f"{name}.codes": m.dtype.is_signed for name, m in model.named_modules()
            if isinstance(m, QdqLinear) and m.width <= 4}


def store_int4(model: Any, weights: Mapping[str, bool]) -> int:
    """Store the initializers named by ``weights`` (an exported name, or one ending in ``"." + name``; value:
    signed) as INT4 / UINT4 in the ``onnx.ModelProto`` ``model`` (in place), at opset 21; returns how many.
    DeployError when one is missing, read by anything but DequantizeLinear, or holds values outside 4 bits,
    or when a node's definition changes at opset 21."""
    import onnx

    if not weights:
        return 0
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    found = {name: _initializer_named(name, inits) for name in weights}
    _upgrade_opset(model)
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replaced = _unsigned_activations(graph, inits, readers)
    for name, init_name in found.items():
        kind = onnx.TensorProto.INT4 if weights[name] else onnx.TensorProto.UINT4
        users = readers.get(init_name, [])
        if not users or any(u.op_type != "DequantizeLinear" or list(u.input).index(init_name) != 0 for u in users):
            raise DeployError(f"store_int4: weight {init_name} is read by {[u.op_type for u in users]}, not only as "
                              "the codes of DequantizeLinear nodes: cannot store it as a 4-bit type")
        _retype(graph, inits[init_name], kind, f"weight {init_name}")
        for i, user in enumerate(users):
            if len(user.input) > 2 and user.input[2]:  # its own zero point: others may share the int8 one
                replaced.add(user.input[2])
                zero = graph.initializer.add()
                zero.CopyFrom(inits[user.input[2]])
                zero.name = user.input[2] = f"{user.input[2]}_int4_{user.name or i}"
                _retype(graph, zero, kind, f"zero point of {init_name}")
    _drop_unread(graph, replaced)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise DeployError(f"store_int4: the model with INT4 weights is not valid ONNX at opset {INT4_OPSET}: "
                          f"{' '.join(str(exc).split())[:600]}") from exc
    return len(found)


def store_int4_file(path: str | Path, weights: Mapping[str, bool]) -> int:
    """:func:`store_int4` on the ONNX file ``path`` (weights inline), rewritten in place; returns the count.
    DeployError when ONNX Runtime cannot load the result (never a silent int8 fallback), or when its optimizer
    turns a DequantizeLinear -> MatMul into MatMulNBits (weight-only layers, whose input is float: at opset 21
    ORT 1.32 does, for 8-bit weights too, and MatMulNBits quantizes that input to int8 at its default accuracy
    level, which is not fxforge's math: measured 2.5276 for 2.5)."""
    import onnx

    if not weights:
        return 0
    model = onnx.load(str(path))
    count = store_int4(model, weights)
    onnx.save(model, str(path))
    fused = _ort_fused(path)
    if fused:
        raise DeployError(f"ONNX Runtime fuses the weight-only layers' DequantizeLinear -> MatMul ({', '.join(fused)}"
                          ") into MatMulNBits at opset 21, which quantizes their float inputs to int8: not the "
                          "simulated math. Give those layers an input quantizer (data_in) or 8-bit weights throughout")
    return count


def _ort_fused(path: Path | str) -> list[str]:
    """The MatMul outputs ORT's optimizer computes with MatMulNBits; DeployError when ORT cannot load ``path``."""
    import tempfile

    import onnx
    import onnxruntime as ort  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        try:
            ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise DeployError(f"ONNX Runtime {ort.__version__} cannot load the QDQ model with INT4 weights (opset "
                              f"{INT4_OPSET}): {' '.join(str(exc).split())[:600]}; quantize those weights to 8 "
                              "bits or deploy the simulated graph with format 'aoti'") from exc
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    return [n.input[1] for n in optimized.graph.node if n.op_type == "MatMulNBits"][:5]  # named after the codes


def _initializer_named(name: str, inits: Mapping[str, Any]) -> str:
    """The one initializer called ``name`` or ending in ``"." + name`` (the exporter may prefix a wrapper's)."""
    if name in inits:
        return name
    matches = [k for k in inits if k.endswith("." + name)]
    if len(matches) != 1:
        raise DeployError(f"store_int4: {len(matches)} initializers of the exported model are named like "
                          f"{name!r} (expected one): cannot tell which holds its 4-bit codes")
    return matches[0]


def _retype(graph: Any, tensor: Any, kind: int, what: str) -> None:
    """Replace ``tensor`` (an int8 / uint8 initializer) by the same values as ``kind`` (INT4 / UINT4), packed."""
    import ml_dtypes
    import numpy as np
    import onnx
    from onnx import numpy_helper

    values = numpy_helper.to_array(tensor).astype(np.int16)
    signed = kind == onnx.TensorProto.INT4
    lo, hi = (-8, 7) if signed else (0, 15)
    if values.size and (values.min() < lo or values.max() > hi):
        raise DeployError(f"store_int4: {what} holds values in [{values.min()}, {values.max()}], outside the "
                          f"{'INT4' if signed else 'UINT4'} range [{lo}, {hi}]")
    packed = numpy_helper.from_array(values.astype(ml_dtypes.int4 if signed else ml_dtypes.uint4), tensor.name)
    tensor.CopyFrom(packed)
    _set_type(graph, tensor.name, kind)


def _set_type(graph: Any, name: str, kind: int) -> None:
    """The recorded element type of ``name`` (value_info, graph inputs) set to ``kind``."""
    for info in (*graph.value_info, *graph.input):
        if info.name == name:
            info.type.tensor_type.elem_type = kind


def _subgraph_nodes(nodes: Any) -> Iterator[Any]:
    """Every node of ``nodes`` and of the graphs in their attributes (If / Loop / Scan bodies)."""
    for node in nodes:
        yield node
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                yield from _subgraph_nodes(sub.node)


def _upgrade_opset(model: Any) -> None:
    """Raise the default domain's opset to 21 (and the IR version to 10) where lower; DeployError naming the first
    node whose op means something else at 21 (exported files hold none: their ops only gained types)."""
    import onnx

    entry = next((o for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if entry is None:
        raise DeployError("store_int4: the model imports no default ONNX opset")
    old = entry.version
    if old >= INT4_OPSET:
        return
    bodies = [model.graph.node, *(f.node for f in model.functions)]  # local functions import the same opset
    for node in (n for body in bodies for n in _subgraph_nodes(body)):
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            before = onnx.defs.get_schema(node.op_type, old).since_version
            after = onnx.defs.get_schema(node.op_type, INT4_OPSET).since_version
        except onnx.defs.SchemaError as exc:
            raise DeployError(f"store_int4: node {node.name!r} ({node.op_type}) has no ONNX schema at opset {old} "
                              f"or {INT4_OPSET}") from exc
        if before != after and node.op_type not in _SAME_MEANING:
            raise DeployError(f"store_int4: node {node.name!r} is a {node.op_type}, whose definition changes "
                              f"between opset {old} and {INT4_OPSET} (the first with INT4 weights): not upgraded; "
                              "quantize the weights to 8 bits instead")
    for imports in (model.opset_import, *(f.opset_import for f in model.functions)):
        for o in imports:
            if o.domain in ("", "ai.onnx"):
                o.version = INT4_OPSET
    model.ir_version = max(model.ir_version, _IR_VERSION)


def _drop_unread(graph: Any, names: set[str]) -> None:
    """Remove the initializers among ``names`` that no node reads any more (zero points replaced by copies)."""
    read = {name for node in _subgraph_nodes(graph.node) for name in node.input} | {o.name for o in graph.output}
    for tensor in [t for t in graph.initializer if t.name in names and t.name not in read]:
        graph.initializer.remove(tensor)


def _unsigned_activations(graph: Any, inits: Mapping[str, Any], readers: Mapping[str, list[Any]]) -> set[str]:
    """Every int8 QuantizeLinear read only by DequantizeLinear nodes (not a graph output) becomes uint8, it and
    its readers' zero points + 128: ``sat_u8(round(x/s) + z + 128) = sat_i8(round(x/s) + z) + 128`` and the DQs
    subtract the same 128, so values are unchanged (see the module docstring for why). Returns the replaced
    zero points' names."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    outputs = {o.name for o in graph.output}
    replaced: set[str] = set()

    def int8_zero(node: Any) -> bool:
        return len(node.input) > 2 and node.input[2] in inits \
            and inits[node.input[2]].data_type == onnx.TensorProto.INT8

    for node in list(graph.node):
        if node.op_type != "QuantizeLinear" or not int8_zero(node) or node.output[0] in outputs:
            continue
        users = readers.get(node.output[0], [])
        if not users or any(u.op_type != "DequantizeLinear" or not int8_zero(u) for u in users):
            continue
        for user in (node, *users):
            shifted = numpy_helper.to_array(inits[user.input[2]]).astype(np.int16) + 128
            zero = numpy_helper.from_array(shifted.astype(np.uint8), f"{user.input[2]}_u8_{user.name}")
            graph.initializer.append(zero)
            replaced.add(user.input[2])
            user.input[2] = zero.name
        _set_type(graph, node.output[0], onnx.TensorProto.UINT8)
    return replaced
