"""Checkpoints store quantized layers' weights packed: the packer graph/checkpoint consults when saving.

For each quantized parameter (``weight``, ``bias``) of the quantize pass's own layers, the packer returns
``pack_layer_weight``'s record -- exactly the values the layer's forward uses -- or the reason it cannot
(:class:`NotPackable`, a subclass whose forward changes the weight first, an embedding renormalising rows in
place). A stored packed tensor reloads as its quantized values, so the checkpoint marks that role's quantizer
``prequantized`` (it passes them through: re-quantizing is not bit-exact for scale-from-range formats), and
the reloaded quantizer keeps the record, so saving the unchanged values again stores the same bytes.
"""

from __future__ import annotations

import copy
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
from .packing import NotPackable, pack_layer_weight
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
    """``module``'s config with the quantizers of the packed ``attrs`` passing their stored values through."""
    out = copy.deepcopy(config)
    for role in attrs:
        out["quantizers"][role]["prequantized"] = True
    return out


def _loaded(module: nn.Module, attr: str, packed: PackedTensor) -> None:
    """Remember on the reloaded quantizer which record its values came from."""
    q = _quantizer(module, attr)
    if q is not None and type(module) in _LAYERS:
        setattr(q, _SOURCE, packed)


PACKER = register_packer(Packer("fxforge.quantize", _pack, _mark, _loaded))
