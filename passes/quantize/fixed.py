"""Integer number formats as pure quantizer functions: MASE fixed point and scaled (affine) integers.

Every quantizer returns the *dequantized* value (simulation) in the input's dtype and has a
straight-through gradient: 1 where the input lies inside the representable range, 0 where it was
clipped. Rounding is round-half-to-even (``torch.round``), as in MASE.
"""

from __future__ import annotations

import torch

__all__ = [
    "straight_through",
    "auto_frac_width",
    "fixed_point_quantize",
    "fixed_point_range",
    "integer_range",
    "scaled_integer_quantize",
    "scale_zero_point",
    "tensor_range",
    "broadcast_along",
]


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized tensor ``q``; backward: the gradient passes where ``mask`` holds."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, q: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        return q

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors  # type: ignore[attr-defined]  # not in torch's FunctionCtx stub
        return torch.where(mask, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None


def _needs_grad(x: torch.Tensor) -> bool:
    """Will :func:`straight_through` build a gradient for ``x`` (else it returns ``q`` and ignores the mask)?"""
    return torch.is_grad_enabled() and x.requires_grad


def straight_through(x: torch.Tensor, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q`` in the forward pass; the clipped straight-through estimator (grad 1 on ``mask``) backward.

    Outside autograd ``q`` is returned as is, so inference results are bit-exact.
    """
    if _needs_grad(x):
        return _StraightThrough.apply(x, q.detach(), mask)
    return q


def integer_range(width: int, signed: bool = True, narrow: bool = False) -> tuple[int, int]:
    """(qmin, qmax) of a ``width``-bit integer; ``narrow`` drops -2^(w-1) (symmetric range)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if not signed:
        return 0, 2**width - 1
    return -(2 ** (width - 1)) + int(narrow), 2 ** (width - 1) - 1


def fixed_point_range(width: int, frac_width: int) -> tuple[float, float]:
    """Smallest and largest value of MASE's signed fixed point (width, frac_width)."""
    qmin, qmax = integer_range(width)
    return qmin / 2.0**frac_width, qmax / 2.0**frac_width


AUTO_FRAC_LIMIT = 64  # |frac_width| an automatic choice may take (the config's own bounds)


def auto_frac_width(amax: torch.Tensor, width: int) -> torch.Tensor:
    """The largest fraction width whose ``width``-bit fixed point still covers ``amax`` (elementwise).

    The integer part then just covers max|x|, so nothing clips and every remaining bit is a fraction bit:
    ``f = floor(log2((2^(w-1)-1) / amax))``, nudged by one where float rounding of the log misses. A zero
    range takes 0 (any fraction width represents zeros exactly). Returns an integer-valued float tensor.
    """
    _, qmax = integer_range(width)
    amax = amax.detach().float().abs()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    f = torch.floor(torch.log2(qmax / safe))
    f = f + (qmax / 2.0 ** (f + 1) >= safe).float() - (qmax / 2.0**f < safe).float()
    f = torch.where(amax > 0, f, torch.zeros_like(f))
    return f.clamp(-AUTO_FRAC_LIMIT, AUTO_FRAC_LIMIT)


def fixed_point_quantize(x: torch.Tensor, width: int, frac_width: int | torch.Tensor) -> torch.Tensor:
    """MASE ``integer`` format: ``clamp(round(x * 2^f), -2^(w-1), 2^(w-1)-1) / 2^f``.

    ``frac_width`` may exceed ``width`` or be negative (a pure power-of-two scale); a tensor of fraction
    widths that broadcasts against ``x`` gives each channel its own (``frac_width: "auto"``). NaN stays NaN.
    """
    scale = torch.pow(2.0, frac_width.to(x.device)) if isinstance(frac_width, torch.Tensor) else 2.0**frac_width
    qmin, qmax = integer_range(width)
    with torch.no_grad():
        q = torch.clamp(torch.round(x * scale), qmin, qmax) / scale
    if not _needs_grad(x):  # the clip mask is only the gradient's (three passes over x saved)
        return q.to(x.dtype)
    lo, hi = qmin / scale, qmax / scale
    return straight_through(x, q.to(x.dtype), (x >= lo) & (x <= hi))


def broadcast_along(t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """Reshape a per-channel vector ``t`` so it broadcasts along ``axis`` of an ``ndim`` tensor."""
    if t.dim() == 0:
        return t
    shape = [1] * ndim
    shape[axis % ndim] = t.numel()
    return t.reshape(shape)


def tensor_range(x: torch.Tensor, axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``x`` over everything (``axis`` None) or per channel along ``axis``."""
    x = x.detach()
    if axis is None:
        return x.amin(), x.amax()
    dims = [d for d in range(x.dim()) if d != axis % x.dim()]
    if not dims:
        return x.clone(), x.clone()
    return x.amin(dim=dims), x.amax(dim=dims)


def scale_zero_point(lo: torch.Tensor, hi: torch.Tensor, width: int,
                     symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point mapping ``[lo, hi]`` onto ``width``-bit integers.

    Symmetric: ``scale = max(|lo|, |hi|) / (2^(w-1)-1)``, zero point 0, integers in the narrow range
    ``[-(2^(w-1)-1), 2^(w-1)-1]`` (what int8 kernels expect of weights). Asymmetric: the range is
    widened to contain 0, ``scale = (hi - lo) / (2^w - 1)`` and unsigned integers ``[0, 2^w-1]``.
    A zero range gives scale 1 (any scale represents zeros exactly).
    """
    lo = lo.detach().float()
    hi = hi.detach().float()
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        _, qmax = integer_range(width, narrow=True)
        amax = torch.maximum(lo.abs(), hi.abs())
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).clamp_min(tiny)
        return scale, torch.zeros_like(scale)
    qmin, qmax = integer_range(width, signed=False)
    lo = torch.clamp(lo, max=0.0)
    hi = torch.clamp(hi, min=0.0)
    span = hi - lo
    scale = torch.where(span > 0, span / (qmax - qmin), torch.ones_like(span)).clamp_min(tiny)
    zero_point = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax)
    return scale, zero_point


def scaled_integer_quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, width: int,
                            symmetric: bool, axis: int | None = None) -> torch.Tensor:
    """Affine integer quantization ``(clamp(round(x / s) + z, qmin, qmax) - z) * s``.

    ``scale``/``zero_point`` are scalars (per tensor) or vectors along ``axis`` (per channel); the
    integer range is the one of :func:`scale_zero_point`.
    """
    if symmetric:
        qmin, qmax = integer_range(width, narrow=True)
    else:
        qmin, qmax = integer_range(width, signed=False)
    if axis is not None:
        scale = broadcast_along(scale, x.dim(), axis)
        zero_point = broadcast_along(zero_point, x.dim(), axis)
    scale = scale.to(x.device)
    zero_point = zero_point.to(x.device)
    with torch.no_grad():
        q = (torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale
    if not _needs_grad(x):
        return q.to(x.dtype)
    lo, hi = (qmin - zero_point) * scale, (qmax - zero_point) * scale
    return straight_through(x, q.to(x.dtype), (x >= lo) & (x <= hi))
