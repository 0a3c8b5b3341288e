"""A-GRU: a gated antisymmetric RNN (Chang et al., 2019), written naively on purpose.

Per layer and time step ``t``::

    A   = W_h - W_h^T - gamma * I                       # rebuilt every step, I from torch.eye every step
    z_t = sigmoid(A h_{t-1} + V_z x_t + b_z)            # update gate
    c_t = tanh(A h_{t-1} + V_h x_t + b_h)               # candidate
    h_t = h_{t-1} + epsilon * z_t * c_t

The Python loop over time, the per-step rebuild of ``A`` and the gates as separate ops are the original's
performance profile: this model is the baseline that fxforge's compiler passes speed up. ``torch.fx``
symbolic tracing cannot follow the loop (expected); ``torch.export`` unrolls it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class AGRUCell(nn.Module):
    """One antisymmetric gated recurrent cell; ``forward(x_t, h) -> h_next``."""

    def __init__(self, input_size: int, hidden_size: int, epsilon: float = 0.1, gamma: float = 0.01) -> None:
        super().__init__()
        if input_size <= 0 or hidden_size <= 0:
            raise ValueError(f"input_size ({input_size}) and hidden_size ({hidden_size}) must be positive")
        if epsilon <= 0 or gamma < 0:
            raise ValueError(f"need epsilon > 0 and gamma >= 0, got epsilon={epsilon}, gamma={gamma}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.epsilon = epsilon
        self.gamma = gamma
        std = 1.0 / math.sqrt(hidden_size)
        self.W_h = nn.Parameter(torch.randn(hidden_size, hidden_size) * std)
        self.V_z = nn.Parameter(torch.randn(hidden_size, input_size) / math.sqrt(input_size))
        self.b_z = nn.Parameter(torch.zeros(hidden_size))
        self.V_h = nn.Parameter(torch.randn(hidden_size, input_size) / math.sqrt(input_size))
        self.b_h = nn.Parameter(torch.zeros(hidden_size))

    def recurrent_matrix(self) -> torch.Tensor:
        """``W_h - W_h^T - gamma I``: antisymmetric part (eigenvalues on the imaginary axis) minus damping."""
        eye = torch.eye(self.hidden_size, dtype=self.W_h.dtype, device=self.W_h.device)
        return self.W_h - self.W_h.t() - self.gamma * eye

    def forward(self, x_t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        A = self.recurrent_matrix()
        recur_z = torch.matmul(h, A.t())
        input_z = torch.matmul(x_t, self.V_z.t())
        z = torch.sigmoid(recur_z + input_z + self.b_z)
        recur_h = torch.matmul(h, A.t())
        input_h = torch.matmul(x_t, self.V_h.t())
        candidate = torch.tanh(recur_h + input_h + self.b_h)
        return h + self.epsilon * z * candidate


class AGRUClassifier(nn.Module):
    """Stacked A-GRU layers over ``x (B, T, input_size)``; a Linear head on the last hidden state -> logits."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_classes: int = 10,
        epsilon: float = 0.1,
        gamma: float = 0.01,
    ) -> None:
        super().__init__()
        if num_layers <= 0 or num_classes <= 1:
            raise ValueError(f"need num_layers >= 1 and num_classes >= 2, got {num_layers}, {num_classes}")
        self.hidden_size = hidden_size
        self.cells = nn.ModuleList(
            [
                AGRUCell(input_size if i == 0 else hidden_size, hidden_size, epsilon, gamma)
                for i in range(num_layers)
            ]
        )
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"expected x of shape (batch, time, features), got {tuple(x.shape)}")
        seq = x
        for cell in self.cells:
            h = torch.zeros(x.size(0), self.hidden_size, dtype=x.dtype, device=x.device)
            outputs = []
            for t in range(x.size(1)):
                h = cell(seq[:, t, :], h)
                outputs.append(h)
            seq = torch.stack(outputs, dim=1)
        return self.head(seq[:, -1, :])


def digits_sequences(
    test_size: float = 0.25, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits as 8 steps of 8 features in [0, 1]: ``(x_train, y_train, x_test, y_test)``.

    The split is stratified and seeded (``sklearn.model_selection.train_test_split``), so it is reproducible.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size must be in (0, 1), got {test_size}")
    digits = load_digits()
    images = digits.images.astype("float32") / 16.0
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, digits.target, test_size=test_size, random_state=seed, stratify=digits.target
    )
    return (
        torch.from_numpy(x_tr),
        torch.from_numpy(y_tr).long(),
        torch.from_numpy(x_te),
        torch.from_numpy(y_te).long(),
    )


def images_to_row_sequences(images: torch.Tensor) -> torch.Tensor:
    """Read images row by row: ``(B, H, W)`` or ``(B, 1, H, W)`` (e.g. MNIST 28x28) -> ``(B, H, W)`` float."""
    if images.dim() == 4:
        if images.size(1) != 1:
            raise ValueError(f"expected a single channel, got {images.size(1)} channels")
        images = images[:, 0]
    if images.dim() != 3:
        raise ValueError(f"expected (B, H, W) or (B, 1, H, W) images, got shape {tuple(images.shape)}")
    images = images.float()
    if images.numel() and images.max() > 1.0:
        images = images / 255.0
    return images
