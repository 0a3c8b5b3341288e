"""Fused row softmax as ``torch.ops.fxforge.softmax`` and ``torch.ops.fxforge.scaled_masked_softmax``.

``softmax(x)`` is ``torch.softmax(x, -1)``; ``scaled_masked_softmax(x, mask, scale)`` is
``torch.softmax(x * scale + mask, -1)`` (attention scores: ``mask`` is additive and broadcasts to ``x``,
e.g. ``(B, 1, 1, T)`` or ``(B, 1, T, T)``; ``None`` means no mask). Both run the Triton kernel on CUDA
(or under ``TRITON_INTERPRET=1``) and the torch reference otherwise; their gradient is the op
``fxforge.softmax_backward``, so fused graphs train, export and compile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .dispatch import triton_module, use_triton


def _triton() -> Any:
    return triton_module("softmax_triton")


# -- references -------------------------------------------------------------------------------------
def softmax_reference(x: Tensor) -> Tensor:
    """The op's meaning in torch: softmax over the last dim."""
    return torch.softmax(x, dim=-1)


def scaled_masked_softmax_reference(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """The op's meaning in torch: ``softmax(x * scale + mask, -1)``."""
    z = x * scale if scale != 1.0 else x
    return torch.softmax(z if mask is None else z + mask, dim=-1)


def softmax_backward_reference(y: Tensor, dy: Tensor) -> Tensor:
    """Gradient w.r.t. the softmax input, ``y * (dy - sum(y * dy, -1))``, accumulated in fp32."""
    yf, dyf = y.float(), dy.float()
    return (yf * (dyf - (yf * dyf).sum(-1, keepdim=True))).to(y.dtype)


def _out_dtype(x: Tensor, mask: Tensor | None) -> torch.dtype:
    return x.dtype if mask is None else torch.promote_types(x.dtype, mask.dtype)


def _check_mask(x: Tensor, mask: Tensor | None) -> None:
    if mask is None:
        return
    try:
        ok = torch.broadcast_shapes(x.shape, mask.shape) == x.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"fxforge.scaled_masked_softmax: mask {tuple(mask.shape)} must broadcast to the "
                         f"scores {tuple(x.shape)}")


# -- ops --------------------------------------------------------------------------------------------
@torch.library.custom_op("fxforge::softmax", mutates_args=())
def softmax(x: Tensor) -> Tensor:
    """Fused softmax over the last dim."""
    if use_triton(x):
        return _triton().softmax_fwd(x, None, 1.0, x.dtype)
    return softmax_reference(x)


@softmax.register_fake
def _softmax_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fxforge::scaled_masked_softmax", mutates_args=())
def scaled_masked_softmax(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Fused ``softmax(x * scale + mask, -1)``."""
    _check_mask(x, mask)
    if use_triton(x):
        return _triton().softmax_fwd(x, mask, scale, _out_dtype(x, mask))
    return scaled_masked_softmax_reference(x, mask, scale)


@scaled_masked_softmax.register_fake
def _scaled_masked_softmax_fake(x: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    _check_mask(x, mask)
    return x.new_empty(x.shape, dtype=_out_dtype(x, mask))


@torch.library.custom_op("fxforge::softmax_backward", mutates_args=())
def softmax_backward(y: Tensor, dy: Tensor) -> Tensor:
    """Gradient w.r.t. a softmax's input given its output ``y`` and output gradient ``dy``."""
    if use_triton(y):
        return _triton().softmax_bwd(y, dy.to(y.dtype))
    return softmax_backward_reference(y, dy)


@softmax_backward.register_fake
def _softmax_backward_fake(y: Tensor, dy: Tensor) -> Tensor:
    return torch.empty_like(y)


# -- autograd ---------------------------------------------------------------------------------------
def _softmax_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(output)


def _softmax_grad(ctx: Any, grad: Tensor) -> Tensor:
    (y,) = ctx.saved_tensors
    return torch.ops.fxforge.softmax_backward(y, grad)


softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)


def _sms_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, mask, scale = inputs
    ctx.save_for_backward(output)
    ctx.scale = scale
    ctx.x_dtype = x.dtype
    ctx.mask_meta = None if mask is None else (mask.shape, mask.dtype)


def _sms_grad(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    (y,) = ctx.saved_tensors
    dz = torch.ops.fxforge.softmax_backward(y, grad)
    dx = (dz * ctx.scale).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    dmask = None
    if ctx.mask_meta is not None and ctx.needs_input_grad[1]:
        shape, dtype = ctx.mask_meta
        dmask = dz.sum_to_size(shape).to(dtype)
    return dx, dmask, None


scaled_masked_softmax.register_autograd(_sms_grad, setup_context=_sms_setup)
