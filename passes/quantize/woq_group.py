"""A weight-only linear for <= 8-bit codes with power-of-two scales per group (MXINT / block_fp at widths 5-8,
or 4-bit ones whose shape the int4 pack refuses), run as a bf16 GEMM on the weight decoded exactly.

Such a weight has no integer kernel (the int4 pack takes 4-bit codes, the int8 kernel one scale per row) but
it is exact in bf16: a signed code of at most 8 bits has at most 8 significant bits, bf16's precision, and a
normal power-of-two scale only moves the exponent. So the layer keeps int8 codes and fp32 power-of-two scales
(nothing else resident), decodes the bf16 weight for each call, and multiplies in bf16 with fp32 sums; only
the activations and the output are rounded, as in the int4 layer's many-rows path (same bound). On CPUs with
bf16 matrix units (AMX) the GEMM is ~3x faster than fp32; without them about as fast as fp32, and still far
faster than simulating the format.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets
from ...graph.packed import LoweredLayer, register_lowered
from .woq_modules import _U_BF16, _accumulation_tol, _bias_bits, _magnitude, _numel

__all__ = ["WeightOnlyGroupLinear"]


class WeightOnlyGroupLinear(nn.Module):
    """``x @ (codes * scale per group of group_size inputs).T + bias`` with int8 codes of ``width`` significant
    bits and power-of-two fp32 scales, computed as a bf16 GEMM (activations and output rounded to bf16)."""

    fxforge_op = "linear"
    weight_int8: torch.Tensor  # buffers (registered in __init__)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, group_size: int = 32, width: int = 8,
                 bias: bool = True) -> None:
        super().__init__()
        if group_size <= 0 or in_features % group_size or not 2 <= width <= 8:
            raise ValueError(f"WeightOnlyGroupLinear needs group_size ({group_size}) > 0 dividing in_features "
                             f"({in_features}) and a width in 2..8 (got {width})")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.group_size, self.width = int(group_size), int(width)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // group_size))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, group_size: int, width: int,
                   bias: torch.Tensor | None) -> WeightOnlyGroupLinear:
        """From signed integer ``codes`` [N, K] within ``width`` bits and power-of-two ``scale`` [N, K // group_size]
        (normal in bf16); ValueError otherwise, since the bf16 weight would then not be exact."""
        n, k = codes.shape
        lo, hi = -(2 ** (width - 1)), 2 ** (width - 1) - 1
        if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
            raise ValueError(f"WeightOnlyGroupLinear: codes outside the signed {width}-bit range [{lo}, {hi}]")
        s = scale.float()
        mantissa, _ = torch.frexp(s)
        if not bool((mantissa == 0.5).all()) or not bool((s >= 2.0**-126).all()) or not bool((s < 2.0**127).all()):
            raise ValueError("WeightOnlyGroupLinear: scales must be normal powers of two (exact in bf16)")
        new = cls(k, n, group_size, width, bias is not None)
        new.weight_int8 = codes.to(torch.int8).contiguous()
        new.weight_scale = s.reshape(n, k // group_size).contiguous()
        new.bias = None if bias is None else bias.detach().float().clone()
        return new

    def _bf16_weight(self) -> torch.Tensor:
        """The weight in bf16, exactly (an 8-bit code times a normal power of two)."""
        q = self.weight_int8.to(torch.bfloat16).unflatten(1, (-1, self.group_size))
        return (q * self.weight_scale.to(torch.bfloat16).unsqueeze(-1)).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = F.linear(x.reshape(-1, self.in_features).to(torch.bfloat16), self._bf16_weight())
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        # in place: y is this call's own tensor, and a second output-sized allocation costs as much as the GEMM
        # on a CPU where fresh pages fault in (measured 1024x1536: 3.6 ms with `y + bias`, 0.9 ms with add_)
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def dequantized_weight(self) -> torch.Tensor:
        return self._bf16_weight().float()

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on |this layer - F.linear(x, dequantized_weight(), bias)|: bf16 rounding of the input
        and of the output (2^-8 each, relative), fp32 accumulation in another order, the bias added."""
        tol = 2 * _U_BF16 + _accumulation_tol(self.in_features)
        return tol * _magnitude(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"width={self.width}, bias={self.bias is not None}, activations=bf16")


def _group_linear_bits(m: nn.Module) -> dict[str, float]:
    """``width`` bits per code (stored one per byte), an fp32 scale per group and row, the fp32 bias."""
    assert isinstance(m, WeightOnlyGroupLinear)
    return {"weight_int8": float(m.width * _numel(m, "weight_int8")), "weight_scale": 32.0 * _numel(m, "weight_scale"),
            **_bias_bits(m)}


targets.register_module(
    WeightOnlyGroupLinear,
    lambda m: {"in_features": m.in_features, "out_features": m.out_features, "group_size": m.group_size,
               "width": m.width, "bias": m.bias is not None},
    lambda c: WeightOnlyGroupLinear(**c),
    name="fxforge.quantize.WeightOnlyGroupLinear",
)
register_lowered(LoweredLayer("fxforge.quantize.WeightOnlyGroupLinear", WeightOnlyGroupLinear,
                              ("weight_int8", "weight_scale", "bias"), _group_linear_bits))
