"""fft_conv: equals irfft(rfft(a) * rfft(b)) forward and backward (float64 gradcheck), in both product forms."""

from __future__ import annotations

import pytest
import torch

from fxforge.passes.transform import fft_conv as fft_conv_module
from fxforge.passes.transform.fft_conv import fft_conv


def _reference(a: torch.Tensor, b: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return torch.fft.irfft(torch.fft.rfft(a, n=n, dim=dim) * torch.fft.rfft(b, n=n, dim=dim), n=n, dim=dim)


# (a shape, b shape, n, dim): broadcast kernel, zero padding to 2T, odd n, truncation (n < length), dim 1
CASES = [((2, 3, 5), (3, 5), 10, -1), ((1, 4, 7), (4, 7), 13, -1), ((2, 6, 3), (2, 6, 3), 4, 1),
         ((3, 9), (1, 9), 8, -1)]


@pytest.mark.parametrize("real_ops", [False, True])  # True: the arithmetic torch.compile traces
@pytest.mark.parametrize("a_shape,b_shape,n,dim", CASES)
def test_fft_conv_matches_reference_and_gradcheck(monkeypatch: pytest.MonkeyPatch, real_ops: bool,
                                                  a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                                                  n: int, dim: int) -> None:
    monkeypatch.setattr(fft_conv_module.torch.compiler, "is_compiling", lambda: real_ops)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(a_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(b_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    out, want = fft_conv(a, b, n, dim), _reference(a, b, n, dim)
    torch.testing.assert_close(out, want)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for got, ref in zip(torch.autograd.grad(out, (a, b), g), torch.autograd.grad(want, (a, b), g)):
        torch.testing.assert_close(got, ref)
    assert torch.autograd.gradcheck(lambda x, y: fft_conv(x, y, n, dim), (a, b))


def test_fft_conv_rejects_complex_and_ambiguous_dims() -> None:
    with pytest.raises(TypeError, match="must be real"):
        fft_conv(torch.randn(4, dtype=torch.complex64), torch.randn(4), 8)
    with pytest.raises(ValueError, match="negative"):
        fft_conv(torch.randn(2, 4), torch.randn(4), 8, dim=1)
