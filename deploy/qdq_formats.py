"""What ONNX QuantizeLinear/DequantizeLinear can express of fxforge's number formats, and the QDQ modules.

ONNX QDQ (as torch.onnx's exporter writes it, opset <= 20; 21 where qdq_int4.py stores <= 4-bit weights as INT4)
computes ``y = saturate(round_half_even(x / s) + z)`` into int8/uint8 and ``(y - z) * s`` back. fxforge's
``integer`` (fixed point: ``round(x * 2^f)`` clamped to the signed width-bit range, half to even, then ``/ 2^f``)
is that with ``s = 2^-f`` exactly (a power of two: the product and the quotient are the same float);
``scaled_integer`` is ``clamp(round(x / s) + z, qmin, qmax)``, the same formula. Where fxforge's range is narrower
than the 8-bit type (symmetric scaled integers use ``[-127, 127]``; widths below 8) a float clamp to
``[(qmin - z) s, (qmax - z) s]`` goes before QuantizeLinear: torch_lib drops ``quant_min``/``quant_max``
(QuantizeLinear saturates to the type's range), and clamping the float first gives exactly the same codes
(division is monotone). Anything else is refused (:class:`DeployError`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  # registers torch.ops.quantized_decomposed
import torch.nn as nn

from ..passes.quantize.fixed import integer_range
from ..passes.quantize.quantizer import Quantize
from .manifest import DeployError

__all__ = ["ActivationQParams", "WeightCodes", "activation_qparams", "check_integer", "weight_codes", "QdqActivation",
           "QdqLinear", "INTEGER_FORMATS"]

_QD = torch.ops.quantized_decomposed
INTEGER_FORMATS = ("integer", "scaled_integer")
_WHY = {
    "minifloat": "its values are not an integer grid with one scale (sign/exponent/mantissa)",
    "block_fp": "a shared exponent per block is computed from the data; fxforge's QDQ export has one static scale "
                "per tensor or per channel",
    "mxint": "an E8M0 scale per block is computed from the data; fxforge's QDQ export has one static scale per "
             "tensor or per channel",
    "mxfp": "an E8M0 scale per block and minifloat elements; fxforge's QDQ export has integer elements and one "
            "scale per tensor or per channel",
}


def _describe(q: Quantize) -> str:
    return f"{q.spec.format}({', '.join(f'{k}={v}' for k, v in q.spec.params)})"


def _refuse(where: str, q: Quantize, why: str) -> DeployError:
    return DeployError(f"to_qdq: {where} ({q.role}) is quantized as {_describe(q)}, which ONNX QDQ cannot express "
                       f"exactly: {why}; quantize it with 'integer' or 'scaled_integer' (width <= 8), keep it float, "
                       "or deploy the simulated graph with format 'aoti'")


def check_integer(where: str, q: Quantize, max_width: int | None = 8) -> None:
    """DeployError naming ``where`` unless ``q`` is an integer format of at most ``max_width`` bits (None: any)."""
    name = q.spec.format
    if name not in INTEGER_FORMATS:
        raise _refuse(where, q, _WHY.get(name, f"format {name!r} has no QDQ form"))
    if max_width is not None and q.params["width"] > max_width:
        raise _refuse(where, q, "fxforge's QDQ export holds at most 8-bit integers (int8/uint8; INT4/UINT4 "
                                "for <= 4 bits)")


def _range(q: Quantize) -> tuple[int, int, torch.dtype]:
    """(qmin, qmax, dtype of the codes) of an integer quantizer."""
    width = q.params["width"]
    if q.fmt.name == "integer":
        lo, hi = integer_range(width)
        return lo, hi, torch.int8
    if q.params["symmetric"]:
        lo, hi = integer_range(width, narrow=True)
        return lo, hi, torch.int8
    lo, hi = integer_range(width, signed=False)
    return lo, hi, torch.uint8


@dataclass(frozen=True)
class ActivationQParams:
    """A static per-tensor activation quantizer as QDQ: codes in ``[qmin, qmax]`` of ``dtype`` (int8 or uint8)."""

    scale: float
    zero_point: int
    qmin: int
    qmax: int
    dtype: torch.dtype

    @property
    def clamp(self) -> tuple[float | None, float | None]:
        """Float bounds to clamp to before QuantizeLinear where fxforge's range is narrower than the type's."""
        info = torch.iinfo(self.dtype)
        lo = (self.qmin - self.zero_point) * self.scale if self.qmin > info.min else None
        hi = (self.qmax - self.zero_point) * self.scale if self.qmax < info.max else None
        return (None if lo is None else float(torch.tensor(lo, dtype=torch.float32)),
                None if hi is None else float(torch.tensor(hi, dtype=torch.float32)))


def activation_qparams(where: str, q: Quantize) -> ActivationQParams:
    """The static scale of an activation quantizer; DeployError naming ``where`` for run-time or non-integer scales."""
    if q.observer is not None:
        raise DeployError(f"to_qdq: {where} ({q.role}) is observing (calibration did not finish)")
    check_integer(where, q)
    qmin, qmax, dtype = _range(q)
    if q.fmt.name == "integer" and not q.auto_fixed:
        return ActivationQParams(2.0 ** -q.params["frac_width"], 0, qmin, qmax, dtype)
    if q.params.get("dynamic", False):
        raise _refuse(where, q, "its scale is computed from each batch at run time ('dynamic'), which ONNX "
                                "expresses only for a linear's 8-bit asymmetric per-tensor input "
                                "(DynamicQuantizeLinear); make it that, or calibrate a static scale")
    if not q.calibrated:
        raise DeployError(f"to_qdq: {where} ({q.role}) takes its scale from calibration and is not calibrated: run "
                          "calibrate_transform_pass first")
    if q.scale.numel() != 1:
        raise _refuse(where, q, "per-channel activation scales are not a QDQ pattern ONNX Runtime runs as integers")
    return ActivationQParams(float(q.scale), int(q.zero_point), qmin, qmax, dtype)


@dataclass(frozen=True)
class WeightCodes:
    """A parameter's integer codes with its scale and zero point (scalars, or vectors along ``axis`` 0)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    qmin: int
    qmax: int
    width: int

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() > 1


def weight_codes(where: str, q: Quantize, w: torch.Tensor) -> WeightCodes:
    """The codes of ``q(w)`` (a weight matrix, channels along dim 0): DeployError unless dequantizing them gives
    ``q(w)`` bit for bit."""
    check_integer(where, q)
    qmin, qmax, dtype = _range(q)
    with torch.no_grad():
        simulated = q(w).float()
        if q.fmt.name == "integer" and not q.auto_fixed:
            scale, zero_point = torch.tensor(2.0 ** -q.params["frac_width"]), torch.tensor(0.0)
        else:
            ctx = q._context(w, q.channel_axis % w.dim(), q.block_axis % w.dim())
            assert ctx.scale is not None and ctx.zero_point is not None  # integer formats always get a scale
            scale, zero_point = ctx.scale.float().reshape(-1), ctx.zero_point.float().reshape(-1)
            if q.is_param and scale.numel() > 1 and scale.numel() != w.shape[0]:
                raise _refuse(where, q, f"{scale.numel()} scales for a weight of {w.shape[0]} rows")
        shape = (-1,) + (1,) * (w.dim() - 1) if scale.numel() > 1 else ()
        s, z = scale.reshape(shape), zero_point.reshape(shape)
        codes = torch.clamp(torch.round(simulated / s) + z, qmin, qmax)
        if not torch.equal((codes - z) * s, simulated):
            raise DeployError(f"to_qdq: {where} ({q.role}): dequantizing the integer codes does not give the "
                              f"simulated {_describe(q)} values bit for bit; not exported")
    return WeightCodes(codes.to(dtype), scale.reshape(-1) if scale.numel() > 1 else scale.reshape(()),
                       zero_point.reshape(-1) if scale.numel() > 1 else zero_point.reshape(()), qmin, qmax,
                       q.params["width"])


class QdqActivation(nn.Module):
    """``DequantizeLinear(QuantizeLinear(x))`` with a static per-tensor scale (after a clamp where needed)."""

    def __init__(self, p: ActivationQParams) -> None:
        super().__init__()
        self.p = p
        self.enabled = True  # read by QuantizedSDPA like a Quantize's
        self.observer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            if isinstance(x, torch.Tensor) and x.is_complex():
                raise DeployError("to_qdq: a quantizer of complex tensors has no QDQ form")
            return x
        p = self.p
        lo, hi = p.clamp
        if lo is not None or hi is not None:
            x = torch.clamp(x, lo, hi)
        info = torch.iinfo(p.dtype)  # QuantizeLinear saturates to the type's range (torch_lib drops quant_min/max)
        codes = _QD.quantize_per_tensor(x, p.scale, p.zero_point, info.min, info.max, p.dtype)
        return _QD.dequantize_per_tensor(codes, p.scale, p.zero_point, info.min, info.max, p.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.p.scale}, zero_point={self.p.zero_point}, range=[{self.p.qmin}, {self.p.qmax}]"


class QdqLinear(nn.Module):
    """``[QDQ(x)] @ DequantizeLinear(W codes^T) + b [QDQ]``: the pattern ONNX Runtime 1.32 fuses into
    MatMulIntegerToFloat (DQ on both MatMul inputs, each DQ read by that MatMul only: see ``dedicate_dq``); ``b``
    is the simulated (quantized) bias in float, added after. Codes are stored transposed (in, out), scales per
    output channel along axis 1. A 2-D input goes through a 3-D MatMul: ORT fuses a 2-D MatMul + Add into a
    float Gemm (level 1) before its QDQ fusion (level 2) sees the DQ -> MatMul pair."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: WeightCodes, bias: torch.Tensor | None, data_in: QdqActivation | None,
                 data_out: QdqActivation | None) -> None:
        super().__init__()
        self.register_buffer("codes", w.codes.t().contiguous())
        self.register_buffer("scale", w.scale.float())
        self.register_buffer("zero_point", w.zero_point.to(torch.int64))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.dtype, self.width = w.codes.dtype, w.width
        # a per-tensor scale is a constant of the graph (a float read from a buffer would not export)
        self.tensor_qparams = None if w.per_channel else (float(w.scale), int(w.zero_point))
        self.data_in, self.data_out = data_in, data_out

    def weight(self) -> torch.Tensor:
        """The dequantized weight (in, out)."""
        info = torch.iinfo(self.dtype)
        if self.tensor_qparams is not None:
            scale, zero_point = self.tensor_qparams
            return _QD.dequantize_per_tensor(self.codes, scale, zero_point, info.min, info.max, self.dtype)
        return _QD.dequantize_per_channel(self.codes, self.scale, self.zero_point, 1, info.min, info.max, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.data_in is not None:
            x = self.data_in(x)
        if x.dim() == 2:  # ORT turns a 2-D MatMul + Add into a float Gemm before its QDQ fusion would run
            y = torch.matmul(x.unsqueeze(0), self.weight()).squeeze(0)
        else:
            y = torch.matmul(x, self.weight())
        if self.bias is not None:
            y = y + self.bias
        return y if self.data_out is None else self.data_out(y)

    def extra_repr(self) -> str:
        return f"in={self.codes.shape[0]}, out={self.codes.shape[1]}, int{self.width} codes as {self.dtype}"
