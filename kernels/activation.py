"""Fused bias + activation ops: ``torch.ops.fxforge.bias_gelu`` and ``torch.ops.fxforge.bias_relu``.

The bias of a linear layer split off and applied in the activation's kernel (a GEMM epilogue):
``bias_gelu(x, bias, approximate)`` is ``F.gelu(x + bias, approximate=approximate)`` ("none" or "tanh"),
``bias_relu(x, bias)`` is ``F.relu(x + bias)``; ``bias`` has shape ``(x.shape[-1],)``. Backward in torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import triton_module, use_triton

GELU_APPROXIMATIONS: tuple[str, ...] = ("none", "tanh")


def bias_gelu_reference(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    """The op's meaning in torch."""
    return F.gelu(x + bias, approximate=approximate)


def bias_relu_reference(x: Tensor, bias: Tensor) -> Tensor:
    """The op's meaning in torch."""
    return F.relu(x + bias)


def _check(x: Tensor, bias: Tensor, approximate: str = "none") -> None:
    if tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"fxforge bias activation: bias {tuple(bias.shape)} must be ({x.shape[-1]},)")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"fxforge.bias_gelu: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def _fake(x: Tensor, bias: Tensor) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, bias.dtype))


@torch.library.custom_op("fxforge::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    """Fused ``gelu(x + bias)``."""
    _check(x, bias, approximate)
    if use_triton(x):
        act = "gelu" if approximate == "none" else "gelu_tanh"
        return triton_module("activation_triton").bias_act_fwd(x, bias, act)
    return bias_gelu_reference(x, bias, approximate)


@bias_gelu.register_fake
def _bias_gelu_fake(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    _check(x, bias, approximate)
    return _fake(x, bias)


@torch.library.custom_op("fxforge::bias_relu", mutates_args=())
def bias_relu(x: Tensor, bias: Tensor) -> Tensor:
    """Fused ``relu(x + bias)``."""
    _check(x, bias)
    if use_triton(x):
        return triton_module("activation_triton").bias_act_fwd(x, bias, "relu")
    return bias_relu_reference(x, bias)


@bias_relu.register_fake
def _bias_relu_fake(x: Tensor, bias: Tensor) -> Tensor:
    _check(x, bias)
    return _fake(x, bias)


# -- autograd ---------------------------------------------------------------------------------------
def gelu_derivative(z: Tensor, approximate: str) -> Tensor:
    """d gelu(z) / dz (fp32), exact or tanh form."""
    if approximate == "tanh":
        k = math.sqrt(2.0 / math.pi)
        u = k * (z + 0.044715 * z**3)
        t = torch.tanh(u)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * z * z)
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + z * pdf


def _bias_grads(ctx: Any, dz: Tensor) -> tuple[Tensor | None, Tensor | None]:
    dx = dz.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    db = dz.sum(tuple(range(dz.dim() - 1))).to(ctx.b_dtype) if ctx.needs_input_grad[1] else None
    return dx, db


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, bias = inputs[0], inputs[1]
    ctx.save_for_backward(x, bias)
    ctx.approximate = inputs[2] if len(inputs) > 2 else None
    ctx.x_dtype, ctx.b_dtype = x.dtype, bias.dtype


def _gelu_grad(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, bias = ctx.saved_tensors
    z = x.float() + bias.float()
    return (*_bias_grads(ctx, dy.float() * gelu_derivative(z, ctx.approximate)), None)


def _relu_grad(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None]:
    x, bias = ctx.saved_tensors
    return _bias_grads(ctx, dy.float() * ((x.float() + bias.float()) > 0))


bias_gelu.register_autograd(_gelu_grad, setup_context=_setup)
bias_relu.register_autograd(_relu_grad, setup_context=_setup)
