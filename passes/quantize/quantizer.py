"""The quantizer module: one role's number format applied to a tensor (real or complex).

:class:`Quantize` is what the quantize pass inserts in front of / behind function ops (``add``,
``matmul``, ``softmax``, FFTs...) and what quantized layers hold per role. Complex tensors are
quantized as their real and imaginary parts (``view_as_real`` -> quantize -> ``view_as_complex``).
Scaled-integer quantizers of activations hold a calibrated ``scale``/``zero_point`` (buffers, so they
are checkpointed); weights and biases derive theirs from the tensor itself. Fixed point with
``frac_width: "auto"`` is a scaled integer whose scale is ``2^-frac_width``: activations keep the
calibrated one in ``scale``; a weight matrix takes one per output row from its rows' max|w|, every other
parameter one per tensor, on every call (so QAT sees the fraction widths move with the weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from ...graph import targets
from .config import RoleSpec
from .fixed import auto_frac_width, scale_zero_point, tensor_range
from .formats import QuantContext, get_format, is_auto_fixed

__all__ = ["Quantize", "Observer", "iter_quantizers"]

CALIBRATION_METHODS: tuple[str, ...] = ("minmax", "percentile")
_SAMPLE = 1 << 20  # elements per channel used for percentiles


class Observer:
    """Collects the range of the tensors a quantizer sees during calibration (fp32 activations).

    ``minmax`` keeps the running extremes; ``percentile`` averages, over batches, the two-sided
    ``percentile`` / ``100 - percentile`` quantiles of each batch (on a strided sample of at most 2^20
    values per channel). ``axis`` None is per tensor, otherwise per channel along ``axis``.
    """

    def __init__(self, method: str = "minmax", percentile: float = 99.99, axis: int | None = None) -> None:
        if method not in CALIBRATION_METHODS:
            raise ValueError(f"calibration method must be one of {list(CALIBRATION_METHODS)}, got {method!r}")
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.method, self.percentile, self.axis = method, float(percentile), axis
        self.min: torch.Tensor | None = None
        self.max: torch.Tensor | None = None
        self.lo_sum: torch.Tensor | None = None
        self.hi_sum: torch.Tensor | None = None
        self.batches = 0
        self.numel = 0

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach()
        axis = self.axis
        if x.is_complex():
            axis = None if axis is None else axis % x.dim()
            x = torch.view_as_real(x)
        x = x.float()
        if x.dim() == 0:
            x, axis = x.reshape(1), None
        lo, hi = tensor_range(x, axis)
        self.min = lo if self.min is None else torch.minimum(self.min, lo)
        self.max = hi if self.max is None else torch.maximum(self.max, hi)
        if self.method == "percentile":
            rows = x.movedim(axis, 0).reshape(x.shape[axis], -1) if axis is not None else x.reshape(1, -1)
            step = max(1, rows.shape[1] // _SAMPLE)
            rows = rows[:, ::step]
            q = torch.tensor([1.0 - self.percentile / 100.0, self.percentile / 100.0])
            qs = torch.quantile(rows, q, dim=1)  # (2, channels)
            plo, phi = (qs[0], qs[1]) if axis is not None else (qs[0, 0], qs[1, 0])
            self.lo_sum = plo if self.lo_sum is None else self.lo_sum + plo
            self.hi_sum = phi if self.hi_sum is None else self.hi_sum + phi
        self.batches += 1
        self.numel += x.numel()

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibrated (lo, hi)."""
        if self.min is None or self.max is None:
            raise RuntimeError("the observer saw no tensor: the quantizer never ran during calibration")
        if self.method == "percentile" and self.lo_sum is not None and self.hi_sum is not None:
            return self.lo_sum / self.batches, self.hi_sum / self.batches
        return self.min, self.max


class Quantize(nn.Module):
    """Quantize a tensor to ``spec``'s format (returns the dequantized value; STE gradient).

    Args:
        spec: the role's format and parameters (a :class:`RoleSpec` or its JSON).
        role: ``data_in`` / ``weight`` / ``bias`` / ``data_out`` (or a slot name such as ``scores``).
        is_param: the tensor is a parameter/constant: scaled formats take its own range.
        channel_axis: the axis of per-channel scales.
        block_axis: the axis blocks of block formats run along.
        calibrated: restored state of a calibrated quantizer (checkpoints).
        scale_shape: shape of the scale/zero_point buffers (() per tensor, (C,) per channel).
        prequantized: the tensor already holds this format's values (a weight decoded from a packed
            checkpoint) and passes through unchanged: re-quantizing it is not bit-exact for formats whose
            scale comes from the tensor's range. Such a layer is for inference or fine-tuning from the
            quantized values; QAT from the float weights needs a checkpoint saved with ``pack=False``.
    """

    fxforge_op = "quantize"
    scale: torch.Tensor  # buffers (registered in __init__): () per tensor, (C,) per channel
    zero_point: torch.Tensor

    def __init__(self, spec: RoleSpec | Mapping[str, Any], role: str = "data_in", is_param: bool = False,
                 channel_axis: int = -1, block_axis: int = -1, calibrated: bool = False,
                 scale_shape: tuple[int, ...] | list[int] = (), prequantized: bool = False) -> None:
        super().__init__()
        self.spec = spec if isinstance(spec, RoleSpec) else RoleSpec.from_json(spec)
        self.fmt = get_format(self.spec.format)
        self.params = self.spec.p
        self.role = str(role)
        self.is_param = bool(is_param)
        self.channel_axis = int(channel_axis)
        self.block_axis = int(block_axis)
        self.calibrated = bool(calibrated)
        self.prequantized = bool(prequantized)
        self.enabled = True
        self.observer: Observer | None = None
        self.register_buffer("scale", torch.ones(tuple(scale_shape)))
        self.register_buffer("zero_point", torch.zeros(tuple(scale_shape)))

    # -- state ---------------------------------------------------------------------------------
    @property
    def per_channel(self) -> bool:
        return self.params.get("granularity") == "per_channel"

    @property
    def auto_fixed(self) -> bool:
        """Fixed point whose fraction width comes from the range (``frac_width: "auto"``)."""
        return is_auto_fixed(self.fmt.name, self.params)

    @property
    def needs_calibration(self) -> bool:
        """An activation quantizer whose static scale comes from calibration (scaled integer, auto fixed point)."""
        ranged = self.fmt.scaled or self.auto_fixed
        return ranged and not self.is_param and not self.params.get("dynamic", False)

    @property
    def bits(self) -> float:
        return self.spec.bits

    def set_range(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Fix the scale/zero point from a calibrated range (scaled formats and auto fixed point; no-op otherwise)."""
        if self.auto_fixed:
            scale, zero_point = self._auto_fixed_scale(lo, hi)
        elif not self.fmt.scaled:
            return
        else:
            scale, zero_point = scale_zero_point(lo, hi, self.params["width"], self.params["symmetric"])
        self.scale = scale.to(self.scale.device)
        self.zero_point = zero_point.to(self.zero_point.device)
        self.calibrated = True

    def to_config(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "role": self.role, "is_param": self.is_param,
                "channel_axis": self.channel_axis, "block_axis": self.block_axis,
                "calibrated": self.calibrated, "scale_shape": list(self.scale.shape),
                "prequantized": self.prequantized}

    @property
    def frac_width(self) -> torch.Tensor | None:
        """The calibrated fraction width(s) of an auto fixed-point activation quantizer (None otherwise)."""
        return -torch.log2(self.scale) if self.auto_fixed and self.calibrated else None

    def _auto_fixed_scale(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.pow(2.0, -auto_frac_width(torch.maximum(lo.abs(), hi.abs()), self.params["width"]))
        return scale, torch.zeros_like(scale)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Quantize:
        return cls(**dict(config))

    def extra_repr(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.spec.params)
        return f"{self.spec.format}({params}), role={self.role}"

    # -- forward -------------------------------------------------------------------------------
    def _context(self, x: torch.Tensor, channel_axis: int, block_axis: int) -> QuantContext:
        if not (self.fmt.scaled or self.auto_fixed):
            return QuantContext(block_axis, channel_axis)
        if self.needs_calibration:
            if not self.calibrated and is_fake(x):  # shape propagation (metadata) only: any scale will do
                return QuantContext(block_axis, channel_axis, self.scale, self.zero_point)
            if not self.calibrated:
                way_out = ("or give it a fixed frac_width" if self.auto_fixed else "or set '<role>_dynamic': True")
                raise RuntimeError(
                    f"{self.role} quantizer ({self.spec.format}, {self.spec.to_json()}) takes its range from "
                    f"calibration and is not calibrated: run calibrate_transform_pass first, {way_out}"
                )
            return QuantContext(block_axis, channel_axis, self.scale, self.zero_point)
        if self.auto_fixed:  # a parameter: per output row of a matrix / kernel, else per tensor
            lo, hi = tensor_range(x, channel_axis if x.dim() >= 2 else None)
            scale, zero_point = self._auto_fixed_scale(lo, hi)
            return QuantContext(block_axis, channel_axis, scale.to(x.device), zero_point.to(x.device))
        lo, hi = tensor_range(x, channel_axis if self.per_channel else None)
        scale, zero_point = scale_zero_point(lo, hi, self.params["width"], self.params["symmetric"])
        return QuantContext(block_axis, channel_axis, scale, zero_point)

    def _quantize(self, x: torch.Tensor, channel_axis: int, block_axis: int) -> torch.Tensor:
        return self.fmt.quantize(x, self.params, self._context(x, channel_axis, block_axis))

    def forward(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
            return x
        if self.observer is not None:
            self.observer.observe(x)
            return x
        if not self.enabled or (self.prequantized and self._holds_packed_values(x)):
            return x
        # Parameters are re-quantized on every call: no cache keyed on the tensor's version counter,
        # which fused/foreach optimizers and ``param.data = ...`` update without bumping.
        return self._forward(x)

    def _holds_packed_values(self, x: torch.Tensor) -> bool:
        """A prequantized quantizer passes through only the values its checkpoint record decodes to: a weight
        changed since (fine-tuning, in place or by a fused optimizer that bumps no version counter) is quantized
        again instead of computing in float behind the config's format; the check costs about one quantization.
        Traced (fake) tensors, and an embedding's looked-up rows (not the whole record), pass through."""
        source = getattr(self, "packed_source", None)  # set by passes/quantize/packed_layers on load
        if source is None or is_fake(x) or torch.compiler.is_compiling():
            return True
        from ...graph.packed import codec

        with torch.no_grad():
            decoded = codec(source.codec).unpack(source)
            y = x.detach().cpu()
            if decoded.numel() != y.numel():  # an embedding's looked-up rows: not the tensor the record holds
                return True
            return y.dtype == torch.float32 and torch.equal(  # bitwise (NaN, -0.0)
                decoded.reshape(y.shape).view(torch.int32), y.contiguous().view(torch.int32))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            return self._quantize(x.reshape(1), 0, 0).reshape(())
        ca, ba = self.channel_axis % x.dim(), self.block_axis % x.dim()
        if x.is_complex():
            return torch.view_as_complex(self._quantize(torch.view_as_real(x), ca, ba).contiguous())
        return self._quantize(x, ca, ba)


def iter_quantizers(root: nn.Module) -> list[tuple[str, Quantize]]:
    """Every Quantize module under ``root`` with its path."""
    return [(name, m) for name, m in root.named_modules() if isinstance(m, Quantize)]


targets.register_module(Quantize, lambda m: m.to_config(), Quantize.from_config,
                        name="fxforge.quantize.Quantize")
