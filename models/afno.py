"""Adaptive Fourier Neural Operator token mixer (AFNO1D) for sequences, with three causality modes.

Modes (``causality``):

* ``"none"``  -- the reference AFNO (Guibas et al.): rfft over tokens, a block-diagonal complex two-layer
  MLP per mode, hard thresholding of high modes, softshrink, irfft, residual. Every token sees every token.
* ``"pad2n"`` -- as in the AFNO-GPT changelog: zero-pad to 2N before the rfft and keep the first N outputs
  after the irfft. This is **not causal**: the ReLU/softshrink (nonlinear in the frequency domain) and the
  hard thresholding (a low-pass filter) spread every token over the whole padded window, so output ``t``
  depends on tokens after ``t``. It is reproduced as written so that the leak can be measured
  (see ``tests/models/test_model_afno.py``).
* ``"causal"`` -- truly causal: token mixing is a *linear* causal convolution with a learned per-channel
  kernel of length ``max_length`` (FFT-convolved with 2N zero padding, so there is no wrap-around), then the
  block-diagonal two-layer MLP and softshrink act per token in the time domain. Here
  ``hard_thresholding_fraction`` keeps the first ``ceil(fraction * max_length)`` kernel taps (a cut-off in
  frequency would make the kernel non-causal).

Everything in ``forward`` is built from tensor ops and config constants so that ``torch.fx.symbolic_trace``
and ``torch.export.export`` both capture it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

CAUSALITY_MODES = ("none", "pad2n", "causal")


class AFNO1D(nn.Module):
    """AFNO token mixer over dim 1 of a ``(batch, tokens, hidden)`` tensor; output has the input's shape."""

    tap_mask: torch.Tensor  # a buffer, in causal mode: which kernel taps are kept

    def __init__(
        self,
        hidden_size: int,
        num_blocks: int = 8,
        sparsity_threshold: float = 0.01,
        hard_thresholding_fraction: float = 1.0,
        hidden_size_factor: int = 1,
        causality: str = "causal",
        max_length: int | None = None,
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or num_blocks <= 0:
            raise ValueError(f"hidden_size ({hidden_size}) and num_blocks ({num_blocks}) must be positive")
        if hidden_size % num_blocks != 0:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_blocks {num_blocks}")
        if not 0.0 < hard_thresholding_fraction <= 1.0:
            raise ValueError(f"hard_thresholding_fraction must be in (0, 1], got {hard_thresholding_fraction}")
        if sparsity_threshold < 0:
            raise ValueError(f"sparsity_threshold must be >= 0, got {sparsity_threshold}")
        if hidden_size_factor < 1:
            raise ValueError(f"hidden_size_factor must be >= 1, got {hidden_size_factor}")
        if causality not in CAUSALITY_MODES:
            raise ValueError(f"causality must be one of {CAUSALITY_MODES}, got {causality!r}")
        if causality == "causal" and (max_length is None or max_length <= 0):
            raise ValueError("causality='causal' needs max_length (the longest sequence, = kernel length)")

        self.hidden_size = hidden_size
        self.num_blocks = num_blocks
        self.block_size = hidden_size // num_blocks
        self.sparsity_threshold = float(sparsity_threshold)
        self.hard_thresholding_fraction = float(hard_thresholding_fraction)
        self.hidden_size_factor = hidden_size_factor
        self.causality = causality
        self.max_length = max_length
        self.scale = 0.02

        nb, bs, hid = num_blocks, self.block_size, self.block_size * hidden_size_factor
        # Spectral modes keep (real, imag) pairs in a leading dim of 2, as the reference implementation does.
        lead = (2,) if causality != "causal" else ()
        self.w1 = nn.Parameter(self.scale * torch.randn(*lead, nb, bs, hid))
        self.b1 = nn.Parameter(self.scale * torch.randn(*lead, nb, hid))
        self.w2 = nn.Parameter(self.scale * torch.randn(*lead, nb, hid, bs))
        self.b2 = nn.Parameter(self.scale * torch.randn(*lead, nb, bs))

        if causality == "causal":
            assert max_length is not None
            self.kernel = nn.Parameter(self._init_kernel(hidden_size, max_length))
            kept = math.ceil(self.hard_thresholding_fraction * max_length)
            self.register_buffer("tap_mask", (torch.arange(max_length) < kept).float()[:, None], persistent=False)

    @staticmethod
    def _init_kernel(channels: int, length: int) -> torch.Tensor:
        """``(length, channels)`` random causal kernels, per-channel decay times log-spaced in [1, length]."""
        tau = torch.logspace(0.0, math.log10(max(length, 2)), channels)
        t = torch.arange(length, dtype=torch.float32)
        envelope = torch.exp(-t[:, None] / tau[None, :]) / tau[None, :].sqrt()
        return torch.randn(length, channels) * envelope

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_blocks={self.num_blocks}, "
            f"sparsity_threshold={self.sparsity_threshold}, "
            f"hard_thresholding_fraction={self.hard_thresholding_fraction}, "
            f"hidden_size_factor={self.hidden_size_factor}, causality={self.causality!r}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.causality == "causal":
            return self._causal_forward(x)
        return self._spectral_forward(x)

    def _spectral_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reference AFNO ("none") or its padded variant ("pad2n"): the MLP acts on Fourier modes."""
        residual = x
        batch, tokens = x.size(0), x.size(1)
        n_fft = 2 * tokens if self.causality == "pad2n" else tokens
        xf = torch.fft.rfft(x, n=n_fft, dim=1, norm="ortho")
        n_modes = xf.size(1)
        xf = xf.reshape(batch, n_modes, self.num_blocks, self.block_size)
        xr, xi = torch.view_as_real(xf).unbind(-1)

        # Hard thresholding: keep modes i < floor(n_modes * fraction), i.e. (i + 1) <= n_modes * fraction.
        modes = torch.arange(n_modes, device=x.device)
        mask = ((modes + 1).to(x.dtype) <= n_modes * self.hard_thresholding_fraction).to(x.dtype)
        mask = mask[:, None, None]

        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        eq = "bmki,kio->bmko"
        o1r = F.relu(torch.einsum(eq, xr, w1[0]) - torch.einsum(eq, xi, w1[1]) + b1[0]) * mask
        o1i = F.relu(torch.einsum(eq, xi, w1[0]) + torch.einsum(eq, xr, w1[1]) + b1[1]) * mask
        o2r = (torch.einsum(eq, o1r, w2[0]) - torch.einsum(eq, o1i, w2[1]) + b2[0]) * mask
        o2i = (torch.einsum(eq, o1i, w2[0]) + torch.einsum(eq, o1r, w2[1]) + b2[1]) * mask

        z = F.softshrink(torch.stack([o2r, o2i], dim=-1), lambd=self.sparsity_threshold)
        z = torch.view_as_complex(z.contiguous()).reshape(batch, n_modes, self.hidden_size)
        y = torch.fft.irfft(z, n=n_fft, dim=1, norm="ortho")
        if self.causality == "pad2n":
            y = y[:, :tokens]
        return y + residual

    def _causal_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal mode: linear causal FFT convolution over tokens, then a per-token block MLP + softshrink."""
        residual = x
        batch, tokens = x.size(0), x.size(1)
        # kernel is stored (max_length, C) so that narrowing to T rows stays contiguous (no shape guards).
        kernel = torch.narrow(self.kernel * self.tap_mask, 0, 0, tokens).to(x.dtype).transpose(0, 1)
        n_fft = 2 * tokens  # >= 2T - 1: the circular convolution equals the linear one, no wrap-around
        xf = torch.fft.rfft(x.transpose(1, 2), n=n_fft, dim=-1)  # (B, C, T + 1), tokens last
        kf = torch.fft.rfft(kernel, n=n_fft, dim=-1)
        u = torch.fft.irfft(xf * kf, n=n_fft, dim=-1)[..., :tokens].transpose(1, 2)
        u = u.reshape(batch, tokens, self.num_blocks, self.block_size)

        eq = "btki,kio->btko"
        h = F.relu(torch.einsum(eq, u, self.w1) + self.b1)
        v = torch.einsum(eq, h, self.w2) + self.b2
        v = F.softshrink(v, lambd=self.sparsity_threshold).reshape(batch, tokens, self.hidden_size)
        return v + residual
