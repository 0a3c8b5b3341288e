"""How :class:`~fxforge.passes.quantize.lower.Int8Linear` turns its float input into the uint8 codes of the kernel.

A lowered layer must quantize its input exactly as the simulated ``data_in`` quantizer it replaces, or the
integer products differ and lowered != simulated beyond float rounding. The simulated dynamic 8-bit
``scaled_integer`` quantizer takes each batch's range (:func:`~fxforge.passes.quantize.fixed.scale_zero_point`):

* ``symmetric``: ``s = max|x| / 127``, codes ``clamp(round(x / s), -127, 127)``; shifted by the zero point 128
  into uint8 (as the static path does), the kernel multiplies the same integers.
* ``asymmetric``: ``s = (max(x, 0) - min(x, 0)) / 255``, zero point ``z = clamp(round(-min(x, 0) / s), 0, 255)``,
  codes ``clamp(round(x / s) + z, 0, 255)``: already uint8.
* ``torch`` (checkpoints written before the scheme was recorded, and layers whose input was not quantized):
  ``torch.quantize_per_tensor_dynamic`` (asymmetric, its own rounding of scale and zero point).

With the simulated scheme the kernel's int32 accumulation is exact, so a lowered layer's output differs from
the simulated layer's on the same input only by the fp32 rounding of the simulated matmul and of the output
scaling (:data:`FP32_BOUND`). Through a network that bound is per layer, not end to end: an fp32 difference
upstream (another GEMM's summation order) can move an input across a rounding boundary, and that code then
differs by one step (MiniLM, 6 layers: logits within a few % of their scale; the tiny test BERT: ~1e-7).
"""

from __future__ import annotations

import warnings

import torch

from .fixed import scale_zero_point, tensor_range
from .modules import QuantizedLinear

__all__ = ["INPUT_SCHEMES", "FP32_BOUND", "dynamic_input_codes", "input_scheme_of", "static_input_range"]

INPUT_SCHEMES: tuple[str, ...] = ("torch", "symmetric", "asymmetric")
FP32_BOUND = ("per output: |lowered - simulated| <= (K + 5) * 2^-24 * (|x_q| @ |w_q|^T + |bias|) with x_q, w_q the "
              "dequantized input and weight and K in_features (fp32 rounding of the simulated matmul and of the "
              "kernel's output scaling; the integer products are exact)")
_QUANTIZED_TENSOR_WARNING = ".*quantized tensor creation functions.*"


def dynamic_input_codes(x: torch.Tensor, scheme: str, reduce_range: bool) -> tuple[torch.Tensor, float, int]:
    """uint8 codes, scale and zero point of a 2-D float ``x`` quantized per tensor from its own range.

    ``scheme`` symmetric/asymmetric reproduces the simulated 8-bit ``data_in`` quantizer bit for bit; ``torch``,
    and any scheme where the kernel needs 7-bit codes (``reduce_range``: it saturates 8-bit ones), uses
    ``torch.quantize_per_tensor_dynamic`` (then lowered and simulated differ by input rounding).
    """
    if scheme not in INPUT_SCHEMES:
        raise ValueError(f"unknown Int8Linear input_scheme {scheme!r}; allowed: {list(INPUT_SCHEMES)}")
    x = x.float()
    if scheme == "torch" or reduce_range:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_QUANTIZED_TENSOR_WARNING)
            q = torch.quantize_per_tensor_dynamic(x, torch.quint8, reduce_range)
        return q.int_repr(), q.q_scale(), q.q_zero_point()
    lo, hi = tensor_range(x)
    symmetric = scheme == "symmetric"
    scale, zero_point = scale_zero_point(lo, hi, 8, symmetric)
    if symmetric:  # the simulated integers in [-127, 127], shifted by 128 into uint8
        xq = torch.clamp(torch.round(x / scale), -127, 127) + 128
        return xq.to(torch.uint8), float(scale), 128
    xq = torch.clamp(torch.round(x / scale) + zero_point, 0, 255)
    return xq.to(torch.uint8), float(scale), int(zero_point)


def input_scheme_of(layer: QuantizedLinear) -> str:
    """The Int8Linear ``input_scheme`` reproducing ``layer``'s dynamic ``data_in`` quantizer (``torch`` if none)."""
    q = layer.data_in_quantizer
    if q is None or q.needs_calibration or not q.fmt.scaled:
        return "torch"
    return "symmetric" if q.params["symmetric"] else "asymmetric"


def static_input_range(layer: QuantizedLinear) -> tuple[float, int] | None:
    """The static uint8 (scale, zero point) of a calibrated data_in quantizer; None if dynamic/absent."""
    q = layer.data_in_quantizer
    if q is None or not q.needs_calibration:
        return None
    scale = float(q.scale)
    return (scale, int(q.zero_point)) if not q.params["symmetric"] else (scale, 128)
