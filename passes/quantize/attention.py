"""Quantized scaled-dot-product attention: the matmuls and softmax hidden inside SDPA.

Export-captured HF models call one fused ``scaled_dot_product_attention`` op (or fxforge's
:class:`ScaledDotProductAttention` module when it has dropout), so there are no separate matmul and
softmax nodes to quantize. :class:`QuantizedSDPA` computes attention explicitly and applies

* the ``matmul`` config to both matmuls as MASE's ``matmul(x, y)`` does: ``data_in`` on the first
  operand (``q``, then the attention probabilities), ``weight`` on the second (``k``, then ``v``),
  ``data_out`` on each product (the raw scores, the attention output);
* the ``softmax`` config: ``data_in`` on the scaled scores *before* the attention mask is added (so
  masked positions stay -inf: quantizing the mask would saturate it to a finite value and un-mask
  padding), ``data_out`` on the probabilities.

Per-channel scales run along the heads axis (-3), whose size is fixed. With every quantizer
disabled the module calls the fused kernel, so it reproduces the float model exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets
from .config import OpQuantConfig
from .quantizer import Quantize

__all__ = ["QuantizedSDPA", "SDPA_SLOTS"]

# slot -> (op config, role, block_axis); channel axis is the heads axis (-3) for all.
SDPA_SLOTS: dict[str, tuple[str, str, int]] = {
    "q": ("matmul", "data_in", -1),
    "k": ("matmul", "weight", -1),
    "scores": ("matmul", "data_out", -1),
    "softmax_in": ("softmax", "data_in", -1),
    "probs": ("softmax", "data_out", -1),
    "probs_matmul": ("matmul", "data_in", -1),
    "v": ("matmul", "weight", -2),
    "out": ("matmul", "data_out", -1),
}


def _parse(cfg: OpQuantConfig | Mapping[str, Any] | None) -> OpQuantConfig | None:
    return cfg if cfg is None or isinstance(cfg, OpQuantConfig) else OpQuantConfig.from_json(cfg)


class QuantizedSDPA(nn.Module):
    """``F.scaled_dot_product_attention`` with quantized operands, scores and probabilities."""

    fxforge_op = "scaled_dot_product_attention"

    def __init__(self, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, matmul: OpQuantConfig | Mapping[str, Any] | None = None,
                 softmax: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        super().__init__()
        self.dropout_p = float(dropout_p)
        self.is_causal = bool(is_causal)
        self.scale = None if scale is None else float(scale)
        self.enable_gqa = bool(enable_gqa)
        self.matmul = _parse(matmul)
        self.softmax = _parse(softmax)
        if self.matmul is None and self.softmax is None:
            raise ValueError("QuantizedSDPA needs a matmul and/or softmax quantization config")
        configs = {"matmul": self.matmul, "softmax": self.softmax}
        for slot, (op, role, block_axis) in SDPA_SLOTS.items():
            module: Quantize | None = None
            cfg = configs[op]
            if quantizers is not None and slot in quantizers:
                module = Quantize.from_config(quantizers[slot])
            elif cfg is not None and (spec := cfg.role(role)) is not None:
                module = Quantize(spec, role, channel_axis=-3, block_axis=block_axis)
            setattr(self, f"{slot}_quantizer", module)

    def quantizers(self) -> dict[str, Quantize]:
        """slot -> quantizer, for the configured slots."""
        return {s: q for s in SDPA_SLOTS if isinstance(q := getattr(self, f"{s}_quantizer"), Quantize)}

    def _q(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        q = getattr(self, f"{slot}_quantizer")
        return x if q is None else q(x)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        dropout_p = self.dropout_p if self.training else 0.0
        active = [q for q in self.quantizers().values() if q.enabled or q.observer is not None]
        if not active:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=self.is_causal, scale=self.scale,
                                                  enable_gqa=self.enable_gqa)
        if self.enable_gqa and key.size(-3) != query.size(-3):
            repeat = query.size(-3) // key.size(-3)
            key = key.repeat_interleave(repeat, dim=-3)
            value = value.repeat_interleave(repeat, dim=-3)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(query.size(-1))
        scores = self._q("q", query) @ self._q("k", key).transpose(-2, -1)
        scores = self._q("softmax_in", self._q("scores", scores) * scale)
        length, source = query.size(-2), key.size(-2)
        if self.is_causal:
            causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        probs = self._q("probs", torch.softmax(scores, dim=-1))
        if dropout_p > 0.0:
            probs = F.dropout(probs, dropout_p, training=True)
        out = self._q("probs_matmul", probs) @ self._q("v", value)
        return self._q("out", out)

    def to_config(self) -> dict[str, Any]:
        return {"dropout_p": self.dropout_p, "is_causal": self.is_causal, "scale": self.scale,
                "enable_gqa": self.enable_gqa,
                "matmul": self.matmul.to_json() if self.matmul else None,
                "softmax": self.softmax.to_json() if self.softmax else None,
                "quantizers": {s: q.to_config() for s, q in self.quantizers().items()}}

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}, is_causal={self.is_causal}, slots={list(self.quantizers())}"


targets.register_module(QuantizedSDPA, lambda m: m.to_config(), lambda c: QuantizedSDPA(**c),
                        name="fxforge.quantize.QuantizedSDPA")
