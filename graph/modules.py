"""Small nn.Modules that normalization inserts so mode-dependent behaviour survives capture."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ScaledDotProductAttention(nn.Module):
    """F.scaled_dot_product_attention whose dropout is active only in train mode.

    torch.export bakes the caller's ``dropout_p if self.training else 0.0`` into a constant; lifting
    the op into this module restores the train/eval switch.
    """

    fxforge_op = "scaled_dot_product_attention"

    def __init__(self, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> None:
        super().__init__()
        self.dropout_p = float(dropout_p)
        self.is_causal = bool(is_causal)
        self.scale = None if scale is None else float(scale)
        self.enable_gqa = bool(enable_gqa)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal, scale=self.scale, enable_gqa=self.enable_gqa,
        )

    def extra_repr(self) -> str:
        return f"dropout_p={self.dropout_p}, is_causal={self.is_causal}, scale={self.scale}"
