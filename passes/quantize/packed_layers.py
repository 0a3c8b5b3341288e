"""Checkpoints store quantized layers' weights packed: the packer graph/checkpoint consults when saving.

For each quantized parameter (``weight``, ``bias``) of the quantize pass's own layers, the packer returns
``pack_layer_weight``'s record -- exactly the values the layer's forward uses -- or the reason it cannot
(:class:`NotPackable`, a subclass whose forward changes the weight first, an embedding renormalising rows in
place). A stored packed tensor reloads as its quantized values, so the checkpoint marks that role's quantizer
``prequantized`` (it passes them through: re-quantizing is not bit-exact for scale-from-range formats), and
the reloaded quantizer keeps the record, so saving the unchanged values again stores the same bytes. Every
other quantizer is saved quantizing; loading refuses a record other than the one the layer's quantizer writes
(it would compute in the record's format) and a ``prequantized`` quantizer without a packed record.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ...graph.packed import PackedTensor, Packer, Unpacked, codec, register_packer
from .modules import (
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedEmbedding,
    QuantizedLayerNorm,
    QuantizedLinear,
)
from .packing import NotPackable, pack_layer_weight, pack_weight
from .quantizer import Quantize

__all__ = ["PACKER", "PACKED_ROLES"]

PACKED_ROLES: tuple[str, ...] = ("weight", "bias")
# Exact types only: a subclass may change the weight before quantizing it (a pruned layer masks it first).
_LAYERS: tuple[type[nn.Module], ...] = (QuantizedLinear, QuantizedConv1d, QuantizedConv2d, QuantizedEmbedding,
                                        QuantizedLayerNorm)
_SOURCE = "packed_source"  # attribute of a reloaded quantizer: the record its values were decoded from


def _quantizer(module: nn.Module, attr: str) -> Quantize | None:
    quantizers = getattr(module, "quantizers", None)
    q = quantizers().get(attr) if callable(quantizers) and attr in PACKED_ROLES else None
    return q if isinstance(q, Quantize) else None


def _pack(module: nn.Module, attr: str, tensor: torch.Tensor) -> PackedTensor | Unpacked | None:
    """The record of ``module``'s quantized ``attr`` as its forward uses it (None: not a quantized parameter)."""
    q = _quantizer(module, attr)
    if q is None:
        return None
    name = type(module).__name__
    if type(module) not in _LAYERS:
        return Unpacked(f"{name} is not one of the quantize pass's own layers {[c.__name__ for c in _LAYERS]}; "
                        "its forward may change the weight before quantizing it")
    if isinstance(module, QuantizedEmbedding) and module.max_norm is not None:
        return Unpacked(f"{name} with max_norm renormalises looked-up rows in place")
    source = getattr(q, _SOURCE, None)
    if q.prequantized and isinstance(source, PackedTensor) and tuple(source.shape) == tuple(tensor.shape):
        with torch.no_grad():
            if torch.equal(codec(source.codec).unpack(source), tensor.detach().cpu()):
                return source  # the values it was loaded with: the same record, byte for byte
    try:
        return pack_layer_weight(module, attr)
    except NotPackable as exc:
        return Unpacked(str(exc))


def _mark(module: nn.Module, config: dict[str, Any], attrs: frozenset[str]) -> dict[str, Any]:
    """``module``'s config with the quantizers of the packed ``attrs`` passing their stored values through, and
    every other quantizer quantizing (a tensor stored fp32 is quantized again when reloaded)."""
    out = copy.deepcopy(config)
    if isinstance(out.get("prequantized"), bool):  # a Quantize module of its own (an activation's)
        out["prequantized"] = False
    quantizers = out.get("quantizers")
    if isinstance(quantizers, dict):
        for role, qc in quantizers.items():
            if isinstance(qc, dict) and "prequantized" in qc:
                qc["prequantized"] = role in attrs
    return out


def _expected(module: nn.Module, attr: str, q: Quantize) -> tuple[str, dict[str, Any]]:
    """The codec and params ``module``'s ``attr`` quantizer writes (they depend on its config and the tensor's
    rank only, so a tensor of ones of that rank shows them)."""
    fresh = Quantize.from_config({**q.to_config(), "prequantized": False})
    flatten = 1 if isinstance(module, (QuantizedConv1d, QuantizedConv2d)) and attr == "weight" else None
    try:
        p = pack_weight(fresh, torch.zeros((1,) * getattr(module, attr).dim()), flatten_from=flatten)
    except NotPackable as exc:
        raise ValueError(f"its quantizer writes no packed record: {exc}") from None
    return p.codec, dict(p.params)


def _check(root: nn.Module, records: Mapping[str, PackedTensor]) -> set[str]:
    """Refuse a packed record the layer's quantizer would not write (another format, width, axis...: the layer
    would silently compute in the record's format) or whose quantizer does not pass it through, and any
    quantizer passing values through (``prequantized``) that were not decoded from such a record."""
    claimed: set[str] = set()
    passing: set[int] = set()
    for name, record in records.items():
        path, _, attr = name.rpartition(".")
        module = root.get_submodule(path)
        q = _quantizer(module, attr)
        if q is None or type(module) not in _LAYERS:
            continue
        if not q.prequantized:
            raise ValueError(f"tensor {name!r} is stored packed, but its quantizer is not marked prequantized "
                             "(the packer marks every packed tensor's quantizer)")
        want = _expected(module, attr, q)
        if (record.codec, dict(record.params)) != want:
            raise ValueError(f"tensor {name!r}: its record ({record.codec!r}, {dict(record.params)}) is not what "
                             f"its quantizer ({q.spec.to_json()}) writes: ({want[0]!r}, {want[1]})")
        claimed.add(name)
        passing.add(id(q))
    for path, m in root.named_modules(remove_duplicate=False):
        if isinstance(m, Quantize) and m.prequantized and id(m) not in passing:
            raise ValueError(f"quantizer {path!r} (role {m.role}) is marked prequantized, but no tensor it "
                             "quantizes was stored packed: it would pass float values through unquantized")
    return claimed


def _loaded(module: nn.Module, attr: str, packed: PackedTensor) -> None:
    """Remember on the reloaded quantizer which record its values came from."""
    q = _quantizer(module, attr)
    if q is not None and type(module) in _LAYERS:
        setattr(q, _SOURCE, packed)


PACKER = register_packer(Packer("fxforge.quantize", _pack, _mark, _loaded, _check))
