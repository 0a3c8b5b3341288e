"""A small GPT with a pluggable token mixer: causal rotary self-attention or AFNO (see ``models/afno.py``).

Pre-LayerNorm blocks ``x = x + s * mixer(ln1(x)); x = x + mlp(ln2(x))`` where ``s = mixer_scale`` scales
only the token-mixer branch (default ``1 / sqrt(2 * n_layer)``, like ``attn_scale`` in modded-nanogpt).
The model returns logits only: the loss (:func:`lm_loss`) and the optimizer parameter groups
(:func:`param_groups`) live outside it so that graph passes see a pure forward.
The forward pass avoids data-dependent Python control flow, so ``torch.fx.symbolic_trace`` and
``torch.export.export`` both capture it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .afno import AFNO1D, CAUSALITY_MODES

MIXERS = ("attn", "afno")


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`; ``afno_*`` fields only matter when ``mixer == "afno"``."""

    vocab_size: int = 256
    sequence_length: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = False
    mixer: str = "attn"
    afno_num_blocks: int = 8
    afno_sparsity_threshold: float = 0.01
    afno_hard_thresholding_fraction: float = 1.0
    afno_hidden_size_factor: int = 1
    afno_causality: str = "causal"
    mixer_scale: float | None = None
    rotary_base: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "sequence_length", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.mixer not in MIXERS:
            raise ValueError(f"GPTConfig.mixer must be one of {MIXERS}, got {self.mixer!r}")
        if self.afno_causality not in CAUSALITY_MODES:
            raise ValueError(f"GPTConfig.afno_causality must be one of {CAUSALITY_MODES}")
        if self.mixer == "attn":
            if self.n_embd % self.n_head != 0:
                raise ValueError(f"n_embd {self.n_embd} must be divisible by n_head {self.n_head}")
            if (self.n_embd // self.n_head) % 2 != 0:
                raise ValueError("the head size n_embd // n_head must be even for rotary embeddings")
        elif self.n_embd % self.afno_num_blocks != 0:
            raise ValueError(f"n_embd {self.n_embd} must be divisible by afno_num_blocks {self.afno_num_blocks}")

    @property
    def resolved_mixer_scale(self) -> float:
        """Scale of the mixer branch: ``mixer_scale`` if set, else ``1 / sqrt(2 * n_layer)``."""
        return self.mixer_scale if self.mixer_scale is not None else 1.0 / math.sqrt(2 * self.n_layer)


class Rotary(nn.Module):
    """Rotary position embedding tables (cos, sin) precomputed for ``max_len`` positions."""

    cos: torch.Tensor  # buffers, (max_len, head_dim / 2)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(B, T, H, D)`` by position; the two halves of D form the pairs."""
        tokens = x.size(1)
        # narrow (not slicing) keeps the buffer slice traceable when ``tokens`` is an fx Proxy.
        cos = torch.narrow(self.cos, 0, 0, tokens)[None, :, None, :].to(x.dtype)
        sin = torch.narrow(self.sin, 0, 0, tokens)[None, :, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary q/k, via ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.rotary = Rotary(self.head_dim, config.sequence_length, config.rotary_base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.size(0), x.size(1)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = self.rotary(q.reshape(batch, tokens, self.n_head, self.head_dim))
        k = self.rotary(k.reshape(batch, tokens, self.n_head, self.head_dim))
        v = v.reshape(batch, tokens, self.n_head, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        y = y.transpose(1, 2).contiguous().reshape(batch, tokens, self.n_embd)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(4x) -> GELU -> Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


def make_mixer(config: GPTConfig) -> nn.Module:
    """Build the token mixer named by ``config.mixer``."""
    if config.mixer == "attn":
        return CausalSelfAttention(config)
    return AFNO1D(
        config.n_embd,
        num_blocks=config.afno_num_blocks,
        sparsity_threshold=config.afno_sparsity_threshold,
        hard_thresholding_fraction=config.afno_hard_thresholding_fraction,
        hidden_size_factor=config.afno_hidden_size_factor,
        causality=config.afno_causality,
        max_length=config.sequence_length,
    )


class Block(nn.Module):
    """One pre-LayerNorm transformer block with a pluggable token mixer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.mixer_scale = config.resolved_mixer_scale
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mixer = make_mixer(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer_scale * self.mixer(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model: ``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # A learned absolute position embedding only for AFNO; attention gets positions from rotary q/k.
        self.wpe = nn.Embedding(config.sequence_length, config.n_embd) if config.mixer == "afno" else None
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=config.bias)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits (B, T, V)`` against ``targets (B, T)``."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)


_DECAY_PARAMS = {nn.Linear: ("weight",), AFNO1D: ("w1", "w2", "kernel")}


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, object]]:
    """Optimizer groups: matrices (Linear weights, AFNO w1/w2/kernel) decay; biases, norms, embeddings don't."""
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    decay: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for kind, names in _DECAY_PARAMS.items():
            if isinstance(module, kind):
                for name in names:
                    param = getattr(module, name, None)
                    if isinstance(param, nn.Parameter) and param.requires_grad:
                        decay[id(param)] = param
    no_decay = [p for p in model.parameters() if p.requires_grad and id(p) not in decay]
    return [
        {"params": list(decay.values()), "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
