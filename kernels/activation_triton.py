"""Triton bias + activation epilogues (bias + GELU, bias + ReLU): one read of x, one write of y.

Elementwise over the flattened tensor in blocks of ``BLOCK_SIZE`` (the tail masked); the bias index
is the column ``offset % width``. GELU is computed in fp32 (exact erf form, or the tanh approximation
written with a sigmoid). Imported lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "relu": 2}


@triton.jit
def _bias_act_kernel(y_ptr, x_ptr, b_ptr, n_elements, n_cols, ACT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid = offs < n_elements
    z = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    z += tl.load(b_ptr + offs % n_cols, mask=valid, other=0.0).to(tl.float32)
    if ACT == 0:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 1:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        y = z * tl.sigmoid(2.0 * u)  # 0.5 * (1 + tanh(u)) == sigmoid(2u)
    else:
        y = tl.maximum(z, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=valid)


def bias_act_fwd(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation(x + bias)`` with the Triton kernel; ``activation`` in :data:`ACTIVATIONS`."""
    x, bias = x.contiguous(), bias.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, bias.dtype), device=x.device)
    n = x.numel()
    if n:
        _bias_act_kernel[(triton.cdiv(n, BLOCK),)](y, x, bias, n, x.shape[-1], ACT=ACTIVATIONS[activation],
                                                   BLOCK_SIZE=BLOCK)
    return y
