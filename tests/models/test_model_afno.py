"""AFNO1D: shapes, gradients, hard thresholding, softshrink sparsity, causality (and the pad2n leak)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxforge.models.afno import AFNO1D


def _perturb_leak(module: torch.nn.Module, tokens: int = 32, t: int = 20, dim: int = 32) -> tuple[float, float]:
    """Max |change| of outputs before / from token ``t`` when only input token ``t`` changes (float64)."""
    module = module.double().eval()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, tokens, dim, generator=gen, dtype=torch.float64)
    x2 = x.clone()
    x2[:, t] += torch.randn(2, dim, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        diff = (module(x) - module(x2)).abs()
    return diff[:, :t].max().item(), diff[:, t:].max().item()


@pytest.mark.parametrize("causality", ["none", "pad2n", "causal"])
def test_shapes_and_gradients(causality: str) -> None:
    m = AFNO1D(32, num_blocks=4, hidden_size_factor=2, causality=causality, max_length=24)
    x = torch.randn(3, 24, 32, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # shorter sequences than max_length work too
    assert m(torch.randn(1, 7, 32)).shape == (1, 7, 32)


def test_parameter_layout_follows_reference() -> None:
    m = AFNO1D(64, num_blocks=8, hidden_size_factor=2, causality="none")
    assert m.w1.shape == (2, 8, 8, 16) and m.b1.shape == (2, 8, 16)
    assert m.w2.shape == (2, 8, 16, 8) and m.b2.shape == (2, 8, 8)
    c = AFNO1D(64, num_blocks=8, hidden_size_factor=2, causality="causal", max_length=10)
    assert c.w1.shape == (8, 8, 16) and c.kernel.shape == (10, 64)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_hard_thresholding_keeps_a_fraction_of_modes(fraction: float) -> None:
    tokens, dim = 32, 16
    m = AFNO1D(dim, num_blocks=4, hard_thresholding_fraction=fraction, sparsity_threshold=0.0, causality="none")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()  # large weights so every kept mode is clearly non-zero
        x = torch.randn(2, tokens, dim)
        spectrum = torch.fft.rfft(m(x) - x, dim=1, norm="ortho").abs()  # the mixer branch, per mode
    n_modes = tokens // 2 + 1
    kept = int(n_modes * fraction)
    if kept < n_modes:
        assert spectrum[:, kept:].max() < 1e-5
    assert (spectrum[:, :kept].amax(dim=(0, 2)) > 1e-3).all()


def test_causal_hard_thresholding_truncates_kernel_taps() -> None:
    m = AFNO1D(8, num_blocks=2, hard_thresholding_fraction=0.25, causality="causal", max_length=16)
    assert m.tap_mask.flatten().tolist() == [1.0] * 4 + [0.0] * 12
    # a change 4+ tokens back no longer reaches the output
    x = torch.randn(1, 16, 8)
    x2 = x.clone()
    x2[:, 3] += 1.0
    with torch.no_grad():
        d = (m(x) - m(x2)).abs().amax(dim=(0, 2))
    assert d[7:].max() < 1e-6 and d[3] > 0


@pytest.mark.parametrize("causality", ["none", "causal"])
def test_softshrink_zeroes_small_coefficients(causality: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = AFNO1D(16, num_blocks=2, sparsity_threshold=0.5, causality=causality, max_length=16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    captured: list[torch.Tensor] = []
    orig = F.softshrink

    def spy(inp: torch.Tensor, lambd: float = 0.5) -> torch.Tensor:
        assert lambd == 0.5
        out = orig(inp, lambd)
        captured.extend([inp.detach(), out.detach()])
        return out

    monkeypatch.setattr(F, "softshrink", spy)
    m(torch.randn(2, 16, 16))
    inp, out = captured
    small = inp.abs() <= 0.5
    assert small.any() and (out[small] == 0).all()
    big = ~small
    assert torch.allclose(out[big], inp[big] - 0.5 * inp[big].sign())


def test_causal_mode_is_causal() -> None:
    before, after = _perturb_leak(AFNO1D(32, num_blocks=4, causality="causal", max_length=32))
    assert before <= 1e-6
    assert after > 1e-3


def test_pad2n_leaks_future_tokens() -> None:
    """Records that "pad to 2N, rfft, MLP, irfft, truncate" is NOT causal (the changelog's claim is false)."""
    torch.manual_seed(0)
    before, _ = _perturb_leak(AFNO1D(32, num_blocks=4, causality="pad2n"))
    assert before > 1e-4


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="divisible"):
        AFNO1D(30, num_blocks=4)
    with pytest.raises(ValueError, match="max_length"):
        AFNO1D(32, num_blocks=4, causality="causal")
    with pytest.raises(ValueError, match="causality"):
        AFNO1D(32, num_blocks=4, causality="future")
    with pytest.raises(ValueError, match="hard_thresholding_fraction"):
        AFNO1D(32, num_blocks=4, hard_thresholding_fraction=0.0, causality="none")
