"""Packed tensors: a quantized weight stored at its format's width, and the registry of codecs that read them.

A checkpoint stores a quantized layer's weight as a :class:`PackedTensor`: a codec name, the codec's
JSON parameters, the logical (unpacked) shape, and a few plain tensors (``parts``: bit-packed codes,
shared exponents, scales). The graph layer knows no format; ``passes.quantize.packing`` registers one
:class:`Codec` per format when fxforge is imported. A loader only ever calls a registered codec, chosen by
name from this fixed table, and asks it for the parts' exact dtypes and shapes before decoding anything,
so a file can neither pick new code nor make the loader allocate more than its bytes hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Codec", "PackedTensor", "PartSpec", "codec", "codec_names", "register_codec"]

PartSpec = tuple[torch.dtype, tuple[int, ...]]  # a part's exact dtype and shape


@dataclass(frozen=True)
class PackedTensor:
    """A tensor at its format's width: ``codec`` names how to read ``parts`` back into ``shape`` (float32)."""

    codec: str
    params: Mapping[str, Any]  # JSON values only (int, float, bool, str, None)
    shape: tuple[int, ...]
    parts: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored parts (what the checkpoint holds for this tensor, before file metadata)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())


@dataclass(frozen=True)
class Codec:
    """How one format is stored and read back.

    ``parts(params, shape)`` returns each part's exact dtype and shape for a logical ``shape``, raising
    ValueError for parameters it does not accept (called before any part is decoded or allocated);
    ``unpack(packed)`` returns the float32 tensor, bit-for-bit the values the format's quantizer produced.
    """

    name: str
    parts: Callable[[Mapping[str, Any], tuple[int, ...]], dict[str, PartSpec]]
    unpack: Callable[[PackedTensor], torch.Tensor]


_CODECS: dict[str, Codec] = {}


def register_codec(c: Codec) -> Codec:
    """Add a codec to the table loaders read from (a name registers once)."""
    if c.name in _CODECS and _CODECS[c.name] is not c:
        raise ValueError(f"packed-tensor codec {c.name!r} is already registered")
    _CODECS[c.name] = c
    return c


def codec(name: Any) -> Codec:
    """The registered codec called ``name``; KeyError naming the known ones otherwise."""
    if not isinstance(name, str) or name not in _CODECS:
        raise KeyError(f"unknown packed-tensor codec {name!r}; known: {sorted(_CODECS)}")
    return _CODECS[name]


def codec_names() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_CODECS)
