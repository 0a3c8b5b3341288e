"""AFNO's spectral block MLP as one op: ``torch.ops.fxforge.afno_mlp`` (see models/afno.py, ``none``/``pad2n``).

``afno_mlp(x, w1, b1, w2, b2, mode_mask, lambd)`` takes the Fourier modes as real pairs ``x`` of shape
``(B, M, K, I, 2)`` (``view_as_real`` of the rfft, reshaped into ``K`` blocks of ``I`` channels), the
complex weights stored as (real, imag) in a leading dim of 2 -- ``w1 (2, K, I, O)``, ``b1 (2, K, O)``,
``w2 (2, K, O, I)``, ``b2 (2, K, I)`` -- and the hard-thresholding mask ``(M,)``; it returns
``softshrink(stack([o2r, o2i], -1), lambd)`` of ``x``'s shape, exactly the model's arithmetic. The
backward is written out in torch (recomputing the hidden layer), so fused graphs train.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import triton_module, use_triton

_EQ = "bmki,kio->bmko"


def _hidden(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
            mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    xr, xi = x.unbind(-1)
    h1r = torch.einsum(_EQ, xr, w1[0]) - torch.einsum(_EQ, xi, w1[1]) + b1[0]
    h1i = torch.einsum(_EQ, xi, w1[0]) + torch.einsum(_EQ, xr, w1[1]) + b1[1]
    o1r, o1i = F.relu(h1r) * mask, F.relu(h1i) * mask
    o2r = (torch.einsum(_EQ, o1r, w2[0]) - torch.einsum(_EQ, o1i, w2[1]) + b2[0]) * mask
    o2i = (torch.einsum(_EQ, o1i, w2[0]) + torch.einsum(_EQ, o1r, w2[1]) + b2[1]) * mask
    return h1r, h1i, o1r, o1i, o2r, o2i


def afno_mlp_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, mode_mask: Tensor,
                       lambd: float) -> Tensor:
    """The op's meaning in torch (the arithmetic of ``AFNO1D._spectral_forward``)."""
    *_, o2r, o2i = _hidden(x, w1, b1, w2, b2, mode_mask[:, None, None])
    return F.softshrink(torch.stack([o2r, o2i], dim=-1), lambd=lambd)


def _check(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, mode_mask: Tensor) -> None:
    if x.dim() != 5 or x.shape[-1] != 2:
        raise ValueError(f"fxforge.afno_mlp: x must be (B, M, K, I, 2), got {tuple(x.shape)}")
    _, modes, blocks, n_in, _ = x.shape
    n_hid = w1.shape[-1]
    want = {"w1": (2, blocks, n_in, n_hid), "b1": (2, blocks, n_hid), "w2": (2, blocks, n_hid, n_in),
            "b2": (2, blocks, n_in), "mode_mask": (modes,)}
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("mode_mask", mode_mask)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"fxforge.afno_mlp: {name} {tuple(t.shape)} must be {want[name]}")


@torch.library.custom_op("fxforge::afno_mlp", mutates_args=())
def afno_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, mode_mask: Tensor,
             lambd: float) -> Tensor:
    """Fused AFNO block-diagonal complex MLP + softshrink on (real, imag) pairs."""
    _check(x, w1, b1, w2, b2, mode_mask)
    if use_triton(x):
        return triton_module("afno_mlp_triton").afno_mlp_fwd(x, w1, b1, w2, b2, mode_mask, lambd)
    return afno_mlp_reference(x, w1, b1, w2, b2, mode_mask, lambd)


@afno_mlp.register_fake
def _afno_mlp_fake(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, mode_mask: Tensor,
                   lambd: float) -> Tensor:
    _check(x, w1, b1, w2, b2, mode_mask)
    return torch.empty_like(x)


def afno_mlp_grads(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, mode_mask: Tensor, lambd: float,
                   dz: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, db1, dw2, db2) of :func:`afno_mlp_reference`, written out (complex chain rule on real pairs)."""
    mask = mode_mask[:, None, None]
    xr, xi = x.unbind(-1)
    h1r, h1i, o1r, o1i, o2r, o2i = _hidden(x, w1, b1, w2, b2, mask)
    dzr, dzi = dz.unbind(-1)
    dh2r, dh2i = dzr * (o2r.abs() > lambd) * mask, dzi * (o2i.abs() > lambd) * mask
    eq_w, eq_t, lead = "bmki,bmko->kio", "bmko,kio->bmki", (0, 1)
    dw2 = torch.stack([torch.einsum(eq_w, o1r, dh2r) + torch.einsum(eq_w, o1i, dh2i),
                       torch.einsum(eq_w, o1r, dh2i) - torch.einsum(eq_w, o1i, dh2r)])
    db2 = torch.stack([dh2r.sum(lead), dh2i.sum(lead)])
    do1r = torch.einsum(eq_t, dh2r, w2[0]) + torch.einsum(eq_t, dh2i, w2[1])
    do1i = torch.einsum(eq_t, dh2i, w2[0]) - torch.einsum(eq_t, dh2r, w2[1])
    dh1r, dh1i = do1r * mask * (h1r > 0), do1i * mask * (h1i > 0)
    dw1 = torch.stack([torch.einsum(eq_w, xr, dh1r) + torch.einsum(eq_w, xi, dh1i),
                       torch.einsum(eq_w, xr, dh1i) - torch.einsum(eq_w, xi, dh1r)])
    db1 = torch.stack([dh1r.sum(lead), dh1i.sum(lead)])
    dxr = torch.einsum(eq_t, dh1r, w1[0]) + torch.einsum(eq_t, dh1i, w1[1])
    dxi = torch.einsum(eq_t, dh1i, w1[0]) - torch.einsum(eq_t, dh1r, w1[1])
    return torch.stack([dxr, dxi], dim=-1), dw1, db1, dw2, db2


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, w1, b1, w2, b2, mode_mask, lambd = inputs
    ctx.save_for_backward(x, w1, b1, w2, b2, mode_mask)
    ctx.lambd = lambd


def _grad(ctx: Any, dz: Tensor) -> tuple[Any, ...]:
    x, w1, b1, w2, b2, mode_mask = ctx.saved_tensors
    dx, dw1, db1, dw2, db2 = afno_mlp_grads(x, w1, b1, w2, b2, mode_mask, ctx.lambd, dz)
    needs = ctx.needs_input_grad
    grads = [g if need else None for g, need in zip((dx, dw1, db1, dw2, db2), needs)]
    return (*grads, None, None)


afno_mlp.register_autograd(_grad, setup_context=_setup)
