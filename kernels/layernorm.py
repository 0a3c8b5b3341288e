"""Fused LayerNorm ops: ``torch.ops.fxforge.layer_norm`` and ``torch.ops.fxforge.add_layer_norm``.

``layer_norm(x, weight, bias, eps)`` is ``F.layer_norm`` over the last dim. ``add_layer_norm(x, residual,
weight, bias, eps)`` returns ``(layer_norm(x + residual), x + residual)`` from one kernel: pre-LN blocks
(GPT) keep the sum as their residual stream, post-LN blocks (BERT) drop it. Weight and bias may be None.
Backward is the LayerNorm gradient in torch (recomputing mean and rstd from the saved input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import triton_module, use_triton


def layer_norm_reference(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """The op's meaning in torch."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_reference(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                             eps: float) -> tuple[Tensor, Tensor]:
    """The op's meaning in torch: ``(layer_norm(x + residual), x + residual)``."""
    s = x + residual
    return layer_norm_reference(s, weight, bias, eps), s


def _check(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None = None) -> None:
    width = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (width,):
            raise ValueError(f"fxforge layer_norm: {name} {tuple(t.shape)} must be ({width},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"fxforge add_layer_norm: residual {tuple(residual.shape)} must match x {tuple(x.shape)}")


@torch.library.custom_op("fxforge::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """Fused LayerNorm over the last dim."""
    _check(x, weight, bias)
    if use_triton(x):
        return triton_module("layernorm_triton").layer_norm_fwd(x, None, weight, bias, eps)[0]
    return layer_norm_reference(x, weight, bias, eps)


@layer_norm.register_fake
def _layer_norm_fake(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    _check(x, weight, bias)
    return torch.empty_like(x)


@torch.library.custom_op("fxforge::add_layer_norm", mutates_args=())
def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float) -> tuple[Tensor, Tensor]:
    """Fused residual add + LayerNorm: ``(layer_norm(x + residual), x + residual)``."""
    _check(x, weight, bias, residual)
    if use_triton(x):
        y, s = triton_module("layernorm_triton").layer_norm_fwd(x, residual, weight, bias, eps)
        return y, s
    return add_layer_norm_reference(x, residual, weight, bias, eps)


@add_layer_norm.register_fake
def _add_layer_norm_fake(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                         eps: float) -> tuple[Tensor, Tensor]:
    _check(x, weight, bias, residual)
    return torch.empty_like(x), torch.empty_like(x)


# -- autograd ---------------------------------------------------------------------------------------
def layer_norm_grads(s: Tensor, weight: Tensor | None, eps: float, dy: Tensor,
                     needs: tuple[bool, bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(d input, d weight, d bias) of LayerNorm over the last dim, in fp32, from the saved input ``s``."""
    sf, dyf = s.float(), dy.float()
    mean = sf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(sf.var(-1, unbiased=False, keepdim=True) + eps)
    xhat = (sf - mean) * rstd
    dxhat = dyf * weight.float() if weight is not None else dyf
    dx = None
    if needs[0]:
        dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dx = dx.to(s.dtype)
    lead = tuple(range(s.dim() - 1))
    dw = (dyf * xhat).sum(lead).to(weight.dtype) if needs[1] and weight is not None else None
    db = dyf.sum(lead) if needs[2] else None
    return dx, dw, db


def _ln_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.bias_dtype = None if bias is None else bias.dtype


def _ln_grad(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
    x, weight = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.bias_dtype is not None)
    dx, dw, db = layer_norm_grads(x, weight, ctx.eps, dy, needs)
    return dx, dw, None if db is None else db.to(ctx.bias_dtype), None


layer_norm.register_autograd(_ln_grad, setup_context=_ln_setup)


def _add_ln_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, residual, weight, bias, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.res_dtype = residual.dtype


def _add_ln_grad(ctx: Any, dy: Tensor, ds: Tensor | None) -> tuple[Any, ...]:
    s, weight = ctx.saved_tensors
    needs = (ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2],
             ctx.needs_input_grad[3] and ctx.bias_dtype is not None)
    dsum, dw, db = layer_norm_grads(s, weight, ctx.eps, dy, needs)
    if dsum is not None and ds is not None:
        dsum = dsum + ds
    dx = dsum if ctx.needs_input_grad[0] else None
    dr = dsum.to(ctx.res_dtype) if ctx.needs_input_grad[1] and dsum is not None else None
    return dx, dr, dw, None if db is None else db.to(ctx.bias_dtype), None


add_layer_norm.register_autograd(_add_ln_grad, setup_context=_add_ln_setup)
