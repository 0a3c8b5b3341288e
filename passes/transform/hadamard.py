"""Orthogonal Hadamard matrices for the rotation passes, and the run-time module that applies one to an input.

Sylvester's construction gives orders 2^k; Paley's first construction gives q + 1 for a prime q ≡ 3 (mod 4)
(4, 8, 12, 20, 24, 32, 44, 48, ...); their Kronecker product covers 2^k·(q + 1): BERT's 384 = 12·32, 768, 1536.
A width with no such order gets a block-diagonal one, I_c ⊗ H_m, with the largest m dividing it.
:class:`HadamardRotation` computes ``x · H`` at run time from the factors (no n×n matrix held), registered in
graph/targets so a checkpoint rebuilds it from its width alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ...graph import targets

__all__ = ["HadamardRotation", "hadamard", "hadamard_factors", "hadamard_matrix", "paley", "rotation_matrix"]


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two), in float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester Hadamard matrices exist for powers of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def _is_paley_prime(q: int) -> bool:
    return q > 2 and q % 4 == 3 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def paley(order: int) -> torch.Tensor:
    """The orthonormal Paley (type I) Hadamard matrix of ``order`` = q + 1, q a prime ≡ 3 mod 4, in float64."""
    q = order - 1
    if not _is_paley_prime(q):
        raise ValueError(f"Paley's construction needs order - 1 prime and 3 mod 4, got order {order}")
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx.unsqueeze(0) - idx.unsqueeze(1)) % q]  # Q[i, j] = χ(j - i), antisymmetric
    s = torch.zeros(order, order, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, jacobsthal
    return (torch.eye(order, dtype=torch.float64) + s) / order ** 0.5


@functools.lru_cache(maxsize=256)
def hadamard_factors(n: int) -> tuple[int, int, int]:
    """(copies c, Paley order a (1: none), Sylvester order b) with c·a·b = n and a·b as large as possible."""
    if n < 1:
        raise ValueError(f"a Hadamard rotation needs a positive width, got {n}")
    best = (n, 1, 1)
    for m in range(1, n + 1):
        if n % m:
            continue
        b = m & -m
        while b >= 1:  # m = a·b, b a power of two (largest first: the Paley factor small), a = 1 or Paley
            a = m // b
            if a == 1 or _is_paley_prime(a - 1):
                best = (n // m, a, b)
                break
            b //= 2
    return best


def hadamard_matrix(n: int) -> tuple[torch.Tensor, int]:
    """(the orthonormal n×n matrix I_c ⊗ H_a ⊗ H_b of :func:`hadamard_factors`, in float64; its block a·b)."""
    c, a, b = hadamard_factors(n)
    block = torch.kron(paley(a) if a > 1 else torch.ones(1, 1, dtype=torch.float64), hadamard(b))
    return torch.kron(torch.eye(c, dtype=torch.float64), block), a * b


def rotation_matrix(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """(orthogonal Q of size ``n`` in float64, its kind): a full Hadamard when one exists, else seeded random."""
    c, _, _ = hadamard_factors(n)
    if c == 1:
        return hadamard_matrix(n)[0], "hadamard"
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0), "random_orthogonal"


class HadamardRotation(nn.Module):
    """``x ↦ x · H`` over the last dimension, H = I_c ⊗ H_a ⊗ H_b orthonormal (see :func:`hadamard_factors`).

    Inserted before a linear whose weight became W·H, so the pair computes what the linear did. Holds only the
    two small factors (buffers rebuilt from ``features``), not the n×n matrix.
    """

    paley_factor: torch.Tensor
    sylvester_factor: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = int(features)
        self.copies, a, b = hadamard_factors(self.features)
        self.register_buffer("paley_factor", (paley(a) if a > 1 else torch.ones(1, 1, dtype=torch.float64)).float())
        self.register_buffer("sylvester_factor", hadamard(b).float())

    def extra_repr(self) -> str:
        return f"features={self.features}, block={self.features // self.copies}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.paley_factor.shape[0], self.sylvester_factor.shape[0]
        y = x.unflatten(-1, (self.copies, a, b))
        y = torch.einsum("...cij,ik,jl->...ckl", y, self.paley_factor.to(x.dtype), self.sylvester_factor.to(x.dtype))
        return y.flatten(-3)


def _config(m: HadamardRotation) -> dict[str, Any]:
    return {"features": m.features}


def _from_config(config: dict[str, Any]) -> HadamardRotation:
    return HadamardRotation(int(config["features"]))


targets.register_module(HadamardRotation, _config, _from_config, name="fxforge.HadamardRotation", keys=("features",))
