"""Linears whose 8-bit input is quantized with a scale from each batch (``dynamic``), as ONNX's dynamic int8 pattern.

fxforge's dynamic asymmetric 8-bit per-tensor ``scaled_integer`` input quantizer computes ``s = (max(x, 0) -
min(x, 0)) / 255`` (1 for an all-zero tensor), ``z = clamp(round(-min(x, 0) / s), 0, 255)`` and codes
``clamp(round(x / s) + z, 0, 255)``, rounding half to even: ONNX's ``DynamicQuantizeLinear``, to the bit (ONNX
Runtime 1.32 and fxforge agreed on scale, zero point and every code for 2,000 random tensors, the all-zero one
included). Such a layer exports as ``DynamicQuantizeLinear -> MatMulInteger(x codes, W codes, z_x, z_w) -> Cast ->
Mul(s_x * s_w) [-> Add(bias)]``, the pattern ONNX Runtime's own ``quantize_dynamic`` writes and ORT fuses into
``DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat`` with the bias (checked in tests/deploy/test_qdq_dynamic.py).

On the torch side the layer calls the custom op ``fxforge_qdq::dynamic_uint8_matmul`` (a CPU implementation doing
the same integer arithmetic, and a fake one for torch.export); :data:`ONNX_TRANSLATIONS` gives torch.onnx's dynamo
exporter its ONNX form. The op exists only in QDQ graphs, which only go to ONNX. Everything else with a run-time
scale (symmetric, other widths, per channel, outputs or activations that are not a linear's input) is refused by
deploy/qdq_formats.py: DynamicQuantizeLinear is per-tensor asymmetric uint8 only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..passes.quantize.fixed import scale_zero_point, tensor_range
from ..passes.quantize.quantizer import Quantize
from .qdq_formats import QdqActivation, WeightCodes

__all__ = ["NAMESPACE", "ONNX_TRANSLATIONS", "QdqDynamicLinear", "is_onnx_dynamic", "dynamic_steps"]

NAMESPACE = "fxforge_qdq"


def is_onnx_dynamic(q: Quantize) -> bool:
    """Is ``q`` an activation quantizer DynamicQuantizeLinear computes exactly (8-bit asymmetric per tensor)?"""
    p = q.params
    return (q.spec.format == "scaled_integer" and bool(p.get("dynamic", False)) and not q.is_param
            and p["width"] == 8 and not p["symmetric"] and p["granularity"] == "per_tensor")


@torch.library.custom_op(f"{NAMESPACE}::dynamic_uint8_matmul", mutates_args=())
def dynamic_uint8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         zero_point: torch.Tensor) -> torch.Tensor:
    """``x`` quantized as DynamicQuantizeLinear does, times the weight codes (in, out) in exact integer arithmetic,
    scaled by ``s_x * scale`` (per output column or per tensor): what ORT's MatMulInteger -> Cast -> Mul computes."""
    lo, hi = tensor_range(x.float())
    s, z = scale_zero_point(lo, hi, 8, symmetric=False)
    xq = torch.clamp(torch.round(x.float() / s) + z, 0, 255)
    # float64 holds every int32 sum of 8-bit products exactly (|sum| < 2^53), as MatMulInteger's int32 does
    acc = (xq.double() - z.double()) @ (codes.double() - zero_point.double())
    return acc.float() * (s * scale.float())


@dynamic_uint8_matmul.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[-1]), dtype=torch.float32)


def _onnx_dynamic_uint8_matmul(x: Any, codes: Any, scale: Any, zero_point: Any) -> Any:
    """The op in ONNX (traced by torch.onnx with onnxscript's opset 18): ORT's dynamic int8 MatMul pattern."""
    from onnxscript import FLOAT
    from onnxscript import opset18 as op

    xq, x_scale, x_zero_point = op.DynamicQuantizeLinear(x)
    acc = op.MatMulInteger(xq, codes, x_zero_point, zero_point)
    return op.Mul(op.Cast(acc, to=FLOAT.dtype), op.Mul(x_scale, scale))


ONNX_TRANSLATIONS: dict[Any, Callable[..., Any]] = {
    torch.ops.fxforge_qdq.dynamic_uint8_matmul.default: _onnx_dynamic_uint8_matmul}


class QdqDynamicLinear(nn.Module):
    """``dynamic_uint8_matmul(x, W codes) + b [QDQ]``: a linear with a dynamic 8-bit input and integer weight codes
    (stored transposed, (in, out); per-channel scales along the output columns); ``b`` is the simulated bias."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: WeightCodes, bias: torch.Tensor | None, data_out: QdqActivation | None) -> None:
        super().__init__()
        self.register_buffer("codes", w.codes.t().contiguous())
        self.register_buffer("scale", w.scale.float().clone())
        self.register_buffer("zero_point", w.zero_point.to(w.codes.dtype).clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.width = w.width
        self.data_out = data_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.fxforge_qdq.dynamic_uint8_matmul(x, self.codes, self.scale, self.zero_point)
        if self.bias is not None:
            y = y + self.bias
        return y if self.data_out is None else self.data_out(y)

    def extra_repr(self) -> str:
        return (f"in={self.codes.shape[0]}, out={self.codes.shape[1]}, int{self.width} codes as {self.codes.dtype}, "
                "dynamic uint8 input")


@contextlib.contextmanager
def dynamic_steps(model: nn.Module) -> Iterator[list[float]]:
    """Within the block, each step (scale) a dynamic activation quantizer of ``model`` takes is appended to the
    yielded list: its maximum over the deploy check's own reference runs is the unit of the check's bound for
    graphs whose input scales come from each batch (no second forward pass needed)."""
    steps: list[float] = []

    def record(q: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0]
        if isinstance(q, Quantize) and isinstance(x, torch.Tensor) and x.is_floating_point():
            lo, hi = tensor_range(x)
            scale, _ = scale_zero_point(lo, hi, int(q.params["width"]), bool(q.params["symmetric"]))
            steps.append(float(scale.max()))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()
             if isinstance(m, Quantize) and m.enabled and not m.is_param and m.params.get("dynamic", False)]
    try:
        yield steps
    finally:
        for h in hooks:
            h.remove()
