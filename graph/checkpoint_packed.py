"""Packed tensors in a checkpoint: which tensors are stored at their format's width, their graph.json record,
and the loader's checks of a record before anything is decoded or allocated.

A packed tensor's entry in graph.json keeps its name, kind, logical ``shape`` and ``dtype`` (float32) and adds
``"packed": {"codec": name, "params": {JSON scalars}, "parts": {part: stored key}}``; each
part lives in weights.safetensors under ``"<tensor name>:<part>"`` (no tensor name holds a colon), and no
float copy is stored. A tensor a packer recognises but cannot pack exactly is stored fp32 as before, its
entry saying why in ``"unpacked"``. Loading picks the codec by name from the fixed table in
:mod:`.packed`, asks ``codec.parts(params, shape)`` for every part's dtype and shape and checks them, the
element count against the logical shape (and the module's declared one) and against the bytes stored,
before ``codec.unpack`` allocates the float tensor.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .packed import PackedTensor, Packer, Unpacked, codec, lowered_layer, packers
from .targets import CheckpointError, is_identifier

__all__ = ["PackPlan", "StoredBytes", "decode_packed", "packed_json", "plan_packing", "stored_bytes"]

PART_SEP = ":"
MAX_PARTS, MAX_PARAMS, MAX_STR = 16, 32, 128
ELEMENTS_PER_BYTE = 8  # no format stores an element in less than one bit: more claimed elements cannot be real
MAX_ELEMENTS = 1 << 48
_PART = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
Use = tuple[str, nn.Module, str, torch.Tensor]  # (module path, module, attribute, tensor)


@dataclass
class PackPlan:
    """What saving stores packed: records by tensor id, fp32 reasons of recognised tensors, module marks."""

    records: dict[int, PackedTensor] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    marks: dict[int, tuple[Packer, set[str]]] = field(default_factory=dict)  # id(module) -> attrs stored packed


def _same(a: PackedTensor, b: PackedTensor) -> bool:
    """Records equal bit for bit (a tied tensor must pack the same way for every module using it)."""
    if (a.codec, dict(a.params), tuple(a.shape), sorted(a.parts)) != (b.codec, dict(b.params), tuple(b.shape),
                                                                      sorted(b.parts)):
        return False
    return all(a.parts[k].dtype == b.parts[k].dtype and a.parts[k].shape == b.parts[k].shape
               and a.parts[k].reshape(-1).view(torch.uint8).equal(b.parts[k].reshape(-1).view(torch.uint8))
               for k in a.parts)


def _pack_use(module: nn.Module, attr: str, t: torch.Tensor) -> tuple[Packer, PackedTensor | Unpacked] | None:
    for p in packers():
        result = p.pack(module, attr, t)
        if result is not None:
            return p, result
    return None


def plan_packing(uses: list[Use], read_directly: set[int], recorded: set[int]) -> PackPlan:
    """Decide, per stored tensor, whether it is stored packed: every module using it must be one a packer
    packs it for, with the same record, and must be recorded with its own config (``recorded`` ids), and no
    graph node may read it directly (``read_directly`` ids)."""
    plan = PackPlan()
    by_tensor: dict[int, list[Use]] = {}
    for use in uses:
        by_tensor.setdefault(id(use[3]), []).append(use)
    for tid, tensor_uses in by_tensor.items():
        results = [(u, _pack_use(u[1], u[2], u[3])) for u in tensor_uses]
        if all(r is None for _, r in results):
            continue
        plain = next((u[0] for u, r in results if r is None), None)
        unpacked = next((r[1].reason for _, r in results if r is not None and isinstance(r[1], Unpacked)), None)
        records = [r[1] for _, r in results if r is not None and isinstance(r[1], PackedTensor)]
        if plain is not None:
            plan.reasons[tid] = f"also used unquantized by {plain or 'the root module'!r}"
        elif tid in read_directly:
            plan.reasons[tid] = "read directly by a graph node (get_attr), which sees the float values"
        elif unpacked is not None:
            plan.reasons[tid] = unpacked
        elif any(tuple(r.shape) != tuple(tensor_uses[0][3].shape) for r in records):
            plan.reasons[tid] = "its packed record's shape is not the tensor's"
        elif any(not _same(records[0], r) for r in records[1:]):
            plan.reasons[tid] = "the modules sharing it quantize it differently"
        elif any(id(u[1]) not in recorded for u in tensor_uses):
            plan.reasons[tid] = "a module using it is rebuilt from its parent's config, which cannot mark it packed"
        else:
            plan.records[tid] = records[0]
            for u, r in results:
                assert r is not None
                plan.marks.setdefault(id(u[1]), (r[0], set()))[1].add(u[2])
    return plan


def packed_json(name: str, p: PackedTensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``packed`` record of tensor ``name`` and its parts under their stored keys."""
    parts = {part: f"{name}{PART_SEP}{part}" for part in sorted(p.parts)}
    doc = {"codec": p.codec, "params": dict(p.params), "parts": parts}
    return doc, {key: p.parts[part] for part, key in parts.items()}


def _fail(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: packed record: {what}"[:600])


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64 or not all(type(s) is int and 0 <= s < MAX_ELEMENTS
                                                                  for s in value):
        raise _fail(where, f"{what} must be a list of at most 64 integers in [0, 2^48)")
    if math.prod(value) >= MAX_ELEMENTS:
        raise _fail(where, f"{what} {value} claims 2^48 elements or more")
    return tuple(value)


def _params(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > MAX_PARAMS:
        raise _fail(where, f"params must be a JSON object of at most {MAX_PARAMS} entries")
    for k, v in value.items():
        if not is_identifier(k) or not (v is None or type(v) in (bool, int, float, str)) \
                or (isinstance(v, str) and len(v) > MAX_STR) or (type(v) is int and abs(v) >= MAX_ELEMENTS):
            raise _fail(where, f"params[{k!r}] must be an identifier naming a JSON scalar (strings of at most "
                               f"{MAX_STR} characters)")
    return dict(value)


def decode_packed(name: str, entry: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                  declared: tuple[int, ...] | None, where: str) -> tuple[torch.Tensor, PackedTensor]:
    """Check tensor ``name``'s packed record against its codec, its parts and ``declared`` (the shape its
    module's config built, if any), then decode it: the float32 tensor of the entry's shape, and the record."""
    doc = entry["packed"]
    if not isinstance(doc, dict) or set(doc) != {"codec", "params", "parts"}:
        raise _fail(where, "must be an object with exactly codec, params, parts")
    if entry.get("dtype") != "float32" or "dim_order" in entry or "alias_of" in entry:
        raise _fail(where, "a packed tensor is float32, stored in its own order and not an alias")
    try:
        c = codec(doc["codec"])
    except KeyError as exc:
        raise _fail(where, str(exc.args[0])) from None
    shape = _shape(entry.get("shape"), where, "the tensor's shape")
    if declared is not None and tuple(declared) != shape:
        raise _fail(where, f"shape {list(shape)}, its module declares {list(declared)}")
    params = _params(doc["params"], where)
    try:
        specs = c.parts(params, shape)
    except Exception as exc:  # noqa: BLE001 - a codec refuses parameters it does not take
        raise _fail(where, f"codec {c.name!r} refuses params {params}: {exc}") from None
    given = doc["parts"]
    if not isinstance(given, dict) or len(given) > MAX_PARTS or set(given) != set(specs) \
            or not all(_PART.fullmatch(k) and v == f"{name}{PART_SEP}{k}" for k, v in given.items()):
        raise _fail(where, f"parts must map exactly {sorted(specs)} to '<tensor name>{PART_SEP}<part>'")
    parts: dict[str, torch.Tensor] = {}
    for part, (dtype, part_shape) in specs.items():
        key = given[part]
        t = weights.get(key)
        if t is None:
            raise _fail(where, f"part {key!r} is missing")
        if t.dtype != dtype or tuple(t.shape) != tuple(part_shape):
            raise _fail(where, f"part {key!r} is {tuple(t.shape)} {t.dtype}; codec {c.name!r} needs "
                               f"{tuple(part_shape)} {dtype}")
        parts[part] = t
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    if math.prod(shape) > ELEMENTS_PER_BYTE * stored:
        raise _fail(where, f"{math.prod(shape)} elements cannot be held by {stored} stored bytes")
    packed = PackedTensor(c.name, params, shape, parts)
    try:
        value = c.unpack(packed)
    except ValueError as exc:  # a codec refuses parts no packer writes (NaN scales, overflowing exponents...)
        raise _fail(where, f"codec {c.name!r} refuses its parts: {exc}") from None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or tuple(value.shape) != shape:
        raise _fail(where, f"codec {c.name!r} did not decode a float32 tensor of shape {list(shape)}")
    return value.contiguous(), packed


@dataclass(frozen=True)
class StoredBytes:
    """Bytes weights.safetensors holds, by what they are: weights packed / at their dtype (parameters and int8
    buffers, as ``weight_bits`` counts them) / of lowered layers (integer codes at the kernel's width, the scales
    it reads and the bias, held as buffers), other buffers and constants, and the file's own header."""

    packed: int
    unpacked: int
    other: int
    header: int
    packed_tensors: int
    unpacked_quantized: dict[str, str]  # tensor name -> why a recognised tensor is stored at its dtype
    lowered: int = 0
    lowered_layers: int = 0

    @property
    def weights(self) -> int:
        return self.packed + self.unpacked + self.lowered

    @property
    def total(self) -> int:
        return self.packed + self.unpacked + self.lowered + self.other + self.header


def _lowered_tensors(graph_doc: Mapping[str, Any]) -> tuple[set[str], int]:
    """Names of the weight tensors of the checkpoint's lowered layers (by their registered class), and how many
    layers hold them."""
    names: set[str] = set()
    layers = 0
    for m in graph_doc.get("modules", []):
        lw = lowered_layer(str(m.get("class")))
        if lw is not None:
            layers += 1
            names.update(f"{m['path']}.{attr}".lstrip(".") for attr in lw.attrs)
    return names, layers


def stored_bytes(graph_doc: Mapping[str, Any], weights_file: bytes) -> StoredBytes:
    """Measure a (verified) checkpoint's weight file: each stored tensor's data bytes, classified by its entry."""
    (size,) = struct.unpack("<Q", weights_file[:8])
    header = json.loads(weights_file[8:8 + size])
    spans = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    lowered_names, layers = _lowered_tensors(graph_doc)
    packed = unpacked = lowered = other = count = 0
    reasons: dict[str, str] = {}
    for e in graph_doc["tensors"]:
        if "alias_of" in e:
            continue
        if "packed" in e:
            packed += sum(spans.get(k, 0) for k in e["packed"]["parts"].values())
            count += 1
            continue
        n = spans.get(e["name"], 0)
        if e["kind"] == "buffer" and e["name"] in lowered_names:
            lowered += n
        elif e["kind"] == "parameter" or (e["kind"] == "buffer" and e.get("dtype") == "int8"):
            unpacked += n
        else:
            other += n
        if "unpacked" in e:
            reasons[e["name"]] = str(e["unpacked"])
    return StoredBytes(packed, unpacked, other, len(weights_file) - sum(spans.values()), count, reasons, lowered,
                       layers)
