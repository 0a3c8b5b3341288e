"""The quantized twin of a pruned Linear: what ``quantize_transform_pass`` swaps a ``PrunedLinear`` for.

It quantizes the *masked* weight (and input), keeps the boolean masks as buffers, so quantization-aware
training cannot revive a pruned weight, checkpoints carry the masks, and int8 lowering reads the masked
weight. Registered with the quantize pass's layer table (passes/quantize/modules.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets
from ..quantize.config import OpQuantConfig
from ..quantize.modules import QuantizedLinear, register_quantized_layer
from .modules import MaskedLayer, PrunedLinear

__all__ = ["QuantizedPrunedLinear"]


class QuantizedPrunedLinear(MaskedLayer, QuantizedLinear):  # type: ignore[misc]  # torch types Linear.bias non-Optional
    """``q_out(F.linear(q_in(act_mask(x)), q_w(W * weight_mask), q_b(b * bias_mask)))``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None, act_sparsity: float = 0.0,
                 act_method: str = "l1", act_scope: str = "local") -> None:
        QuantizedLinear.__init__(self, in_features, out_features, bias, quant, quantizers)
        self._init_masks(act_sparsity, act_method, act_scope)

    @classmethod
    def from_float(cls, layer: nn.Module, quant: OpQuantConfig) -> QuantizedPrunedLinear:
        """The quantized twin of a PrunedLinear (the layer this class is registered for), masks copied."""
        if not isinstance(layer, PrunedLinear):
            raise TypeError(f"QuantizedPrunedLinear quantizes a PrunedLinear, got a {type(layer).__name__}")
        with torch.device("meta"):
            new = cls(layer.in_features, layer.out_features, layer.bias is not None, quant, **layer.mask_config())
        QuantizedLinear._adopt(new, layer)  # shared parameters, quantizers built on the layer's device
        new.weight_mask = layer.weight_mask.clone()
        new.bias_mask = None if layer.bias_mask is None else layer.bias_mask.clone()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._q("data_in", self.masked_input(x)), self._q("weight", self.masked_weight()),
                     self._q("bias", self.masked_bias()))
        return self._q("data_out", y)

    def extra_repr(self) -> str:
        return f"{QuantizedLinear.extra_repr(self)}, {self.extra_repr_masks()}"


def _config(m: QuantizedPrunedLinear) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None,
            **m.quant_config(), **m.mask_config()}


register_quantized_layer(PrunedLinear, QuantizedPrunedLinear)
targets.register_module(QuantizedPrunedLinear, _config, lambda c: QuantizedPrunedLinear(**c),
                        name="fxforge.QuantizedPrunedLinear")
