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
import torch.nn as nn

__all__ = ["Codec", "LoweredLayer", "PackedTensor", "Packer", "PartSpec", "Unpacked", "codec", "codec_names",
           "lowered_layer", "lowered_weight_bits", "packers", "register_codec", "register_lowered", "register_packer"]

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


def _register(table: dict[str, Any], name: str, item: Any, what: str) -> None:
    """Add ``item`` to one of this module's tables; a name registers once (re-registering the same is a no-op)."""
    if name in table and table[name] != item:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = item


def register_codec(c: Codec) -> Codec:
    """Add a codec to the table loaders read from (a name registers once)."""
    _register(_CODECS, c.name, c, "packed-tensor codec")
    return c


def codec(name: Any) -> Codec:
    """The registered codec called ``name``; KeyError naming the known ones otherwise."""
    if not isinstance(name, str) or name not in _CODECS:
        raise KeyError(f"unknown packed-tensor codec {name!r}; known: {sorted(_CODECS)}")
    return _CODECS[name]


def codec_names() -> list[str]:
    """Names of the registered codecs."""
    return sorted(_CODECS)


@dataclass(frozen=True)
class Unpacked:
    """A tensor a packer recognises (a quantized layer's weight) but stores fp32: ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class Packer:
    """How a checkpoint stores the tensors of modules a pass inserted (quantized layers) at their width.

    ``pack(module, attr, tensor)`` returns the :class:`PackedTensor` whose decoded values ``module`` uses
    exactly as it uses ``tensor``, an :class:`Unpacked` reason, or None for a use it does not know;
    ``mark(module, config, attrs)`` returns the checkpoint config of every recorded module once ``attrs`` (maybe
    none) are stored packed (e.g. its quantizers pass exactly those decoded values through, no others);
    ``loaded(module, attr, packed)`` is told what a checkpoint decoded, so saving the unchanged tensor again
    stores the very same record; ``check(root, records)`` is given the loaded module tree and the records of
    the tensors stored packed (by tensor name, aliases included): it raises ValueError where a module it packs
    disagrees with what was stored (a record its config would not write, a pass-through without a record) and
    returns the names it accounts for -- a record no packer accounts for is refused.
    """

    name: str
    pack: Callable[[nn.Module, str, torch.Tensor], PackedTensor | Unpacked | None]
    mark: Callable[[nn.Module, dict[str, Any], frozenset[str]], dict[str, Any]]
    loaded: Callable[[nn.Module, str, PackedTensor], None]
    check: Callable[[nn.Module, Mapping[str, PackedTensor]], set[str]]


_PACKERS: dict[str, Packer] = {}


def register_packer(p: Packer) -> Packer:
    """Add a packer checkpoints consult when saving (a name registers once)."""
    _register(_PACKERS, p.name, p, "tensor packer")
    return p


def packers() -> list[Packer]:
    """The registered packers, in registration order."""
    return list(_PACKERS.values())


@dataclass(frozen=True)
class LoweredLayer:
    """A lowered layer class (a pass's module running a real low-bit kernel) whose weight lives in buffers.

    ``attrs`` name the buffers that are its weight (integer codes, the scales the kernel reads, the bias), so a
    checkpoint's report counts them as weight bytes; ``bits(module)`` gives each present one's accounted bits at
    the format's width (codes at their bit width, not their container's). ``name`` is the class's checkpoint
    name (``targets.register_module``): the graph layer finds lowered layers in a checkpoint without importing
    the passes that define them.
    """

    name: str
    module_type: type[nn.Module]
    attrs: tuple[str, ...]
    bits: Callable[[nn.Module], dict[str, float]]


_LOWERED: dict[str, LoweredLayer] = {}


def register_lowered(layer: LoweredLayer) -> LoweredLayer:
    """Add a lowered layer class to the table reports and the weight accounting read (a name registers once)."""
    _register(_LOWERED, layer.name, layer, "lowered layer")
    return layer


def lowered_layer(which: nn.Module | str) -> LoweredLayer | None:
    """The registration of a module (by exact type) or of a checkpoint class name; None if it is not lowered."""
    if isinstance(which, str):
        return _LOWERED.get(which)
    return next((lw for lw in _LOWERED.values() if type(which) is lw.module_type), None)


def lowered_weight_bits(model: nn.Module) -> tuple[float, set[int]]:
    """Accounted bits of every lowered layer's weight buffers in ``model`` (each tensor once), and their ids."""
    total, seen = 0.0, set()
    for module in model.modules():
        lw = lowered_layer(module)
        if lw is None:
            continue
        for attr, bits in lw.bits(module).items():
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += float(bits)
    return total, seen
