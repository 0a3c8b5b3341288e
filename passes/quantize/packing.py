"""Pack a quantized layer's parameter at its format's width, and register the codecs that read it back.

``pack_weight(q, w)`` stores ``q(w)`` -- the values the simulated layer multiplies with -- as a
:class:`~fxforge.graph.packed.PackedTensor`: integer codes of exactly the format's width in a little-endian bit
stream, plus the format's shared exponents / scales. ``codec(p.codec).unpack(p)`` returns those values again,
bit for bit (integer-coded formats, which have no negative zero, read a ``-0.0`` back as ``+0.0``). The quantizer
runs once per pack (packers derive codes from its output), and every pack is checked by unpacking it: a weight
that cannot be stored exactly (NaN in an integer format, a dtype other than float32, a disabled quantizer...)
raises :class:`NotPackable`, never an approximation.

Codecs (registered in graph/packed's table at import, so loaders find them by name):

* ``int``       -- integer (fixed point, fixed or per-row power-of-two fraction widths) and scaled_integer;
* ``minifloat`` -- minifloat bit patterns (sign, exponent, mantissa);
* ``block``     -- block_fp and mxint: two's complement elements + one biased shared exponent per block;
* ``mxfp``      -- MX float elements (bit patterns) + one E8M0 scale per block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ...graph.packed import PackedTensor, codec, register_codec
from .packing_bits import NotPackable, view_shape
from .packing_block import BLOCK_CODEC, MXFP_CODEC, pack_block, pack_mxfp
from .packing_float import MINIFLOAT_CODEC, pack_minifloat
from .packing_int import INT_CODEC, pack_int
from .quantizer import Quantize

__all__ = ["NotPackable", "PACKERS", "pack_weight", "pack_layer_weight", "packed_bits", "unpack"]

# (quantizer, x: the view it sees, ref: quantizer(x) in that view, channel axis, block axis, shape, flatten_from)
Packer = Callable[[Quantize, torch.Tensor, torch.Tensor, int, int, tuple[int, ...], "int | None"], PackedTensor]

# format name -> packer; a codec whose codes carry the sign of zero is checked bit for bit.
PACKERS: dict[str, Packer] = {"integer": pack_int, "scaled_integer": pack_int, "minifloat": pack_minifloat,
                              "block_fp": pack_block, "mxint": pack_block, "mxfp": pack_mxfp}
_SIGNED_ZERO: frozenset[str] = frozenset({"minifloat", "mxfp"})  # codecs whose codes keep -0.0 (float formats)

for _c in (INT_CODEC, MINIFLOAT_CODEC, BLOCK_CODEC, MXFP_CODEC):
    register_codec(_c)


def unpack(packed: PackedTensor) -> torch.Tensor:
    """The float32 tensor a packed tensor holds (its registered codec's ``unpack``)."""
    return codec(packed.codec).unpack(packed)


def packed_bits(packed: PackedTensor) -> int:
    """Bits the packed tensor's parts occupy (``8 * nbytes``)."""
    return 8 * packed.nbytes


def _same(a: torch.Tensor, b: torch.Tensor, bitwise: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) if bitwise else torch.equal(a, b)


def pack_weight(quantizer: Quantize, weight: torch.Tensor, *, flatten_from: int | None = None) -> PackedTensor:
    """``quantizer(weight)`` stored at its format's width (the quantizer's own channel and block axes).

    ``flatten_from``: the quantizer sees ``weight.flatten(flatten_from)`` (conv layers quantize their kernel as
    (out, in * kernel): 1); the packed tensor keeps ``weight``'s shape. Raises :class:`NotPackable` with the
    reason when the values cannot be stored exactly.
    """
    where = f"pack_weight ({quantizer.spec.format}, role {quantizer.role})"
    if not quantizer.enabled or quantizer.observer is not None:
        raise NotPackable(f"{where}: the quantizer is disabled or calibrating, so it returns the float weight")
    if weight.dtype != torch.float32:
        raise NotPackable(f"{where}: weights of dtype {weight.dtype} are not packable (float32 only); "
                          "convert the model with .float() first")
    packer = PACKERS.get(quantizer.fmt.name)
    if packer is None:
        raise NotPackable(f"{where}: format {quantizer.fmt.name!r} has no codec; packable: {sorted(PACKERS)}")
    shape = tuple(weight.shape)
    if flatten_from is not None and not 0 <= flatten_from < max(len(shape), 1):
        raise ValueError(f"{where}: flatten_from {flatten_from} is not an axis of a weight of shape {shape}")
    w = weight.detach().to("cpu")
    x = w.flatten(flatten_from) if flatten_from is not None else w
    with torch.no_grad():
        view = view_shape(shape, flatten_from)
        ref = quantizer(x).reshape(view)  # the quantizer runs once: packers derive their codes from ref
        x = x.reshape(view)
        packed = packer(quantizer, x, ref, quantizer.channel_axis % x.dim(), quantizer.block_axis % x.dim(), shape,
                        flatten_from)
        ref = ref.reshape(shape)
        try:
            out = unpack(packed)
        except ValueError as exc:  # e.g. an infinite weight's codes times scales overflow: no exact record
            raise NotPackable(f"{where}: {exc}") from None
    if not _same(out, ref, packed.codec in _SIGNED_ZERO):
        raise NotPackable(f"{where}: the packed codes do not reproduce the quantizer's values exactly "
                          f"(codec {packed.codec!r}, params {dict(packed.params)})")
    return packed


def pack_layer_weight(layer: nn.Module, role: str = "weight") -> PackedTensor:
    """The packed ``role`` parameter (``weight`` / ``bias``) of a quantized layer, as its forward quantizes it."""
    from .modules import _QuantizedConv, _QuantizedLayer

    if not isinstance(layer, _QuantizedLayer):
        raise TypeError(f"pack_layer_weight needs a quantized layer, got {type(layer).__name__}")
    q = layer.quantizers().get(role)
    param = getattr(layer, role, None)
    if q is None or not isinstance(param, torch.Tensor):
        raise ValueError(f"{type(layer).__name__} has no quantized {role!r} parameter; it has "
                         f"{sorted(layer.quantizers())}")
    flatten = 1 if isinstance(layer, _QuantizedConv) and role == "weight" else None
    return pack_weight(q, param, flatten_from=flatten)
