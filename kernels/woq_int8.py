"""Int8 weight-only linear for CPU decode: ``x @ (w_int8 * scale[:, None]).T + bias``.

The public entry point is :func:`int8_weight_only_linear`; the lowering pass calls it. For now it runs
the stock ATen op ``_weight_int8pack_mm`` (exact up to fp32 accumulation order).
"""

from __future__ import annotations

import torch
from torch import Tensor


def int8_weight_only_linear(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ (w_int8 * scale[:, None]).T (+ bias)`` with ``w_int8`` [N, K] int8 and ``scale`` [N] fp32."""
    lead = x.shape[:-1]
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), w_int8, scale)
    y = y.reshape(*lead, w_int8.shape[0])
    return y if bias is None else y + bias
