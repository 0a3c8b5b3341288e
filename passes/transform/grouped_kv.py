"""GroupedKVLinear: a key / value projection converted to grouped-query attention (attention_swap_transform_pass).

A projection whose output columns ``[start, start + heads * head_dim)`` hold one attention's key (or value)
heads keeps only ``groups`` heads there: each the mean of the ``heads / groups`` consecutive heads it replaces
(the GQA paper's mean-pooling of key/value heads). On output each kept head is repeated to the heads it stands
for, so every reader of the projection (reshape to heads, rotary embedding, SDPA) sees the shape it saw before
and computes exactly grouped-query attention; the weights (and the projection's work) shrink by
``heads / groups`` in those columns. Other columns (the query part of a fused qkv projection) are kept as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets

__all__ = ["GroupedKVLinear", "Segment"]

Segment = tuple[int, int, int, int]  # (start column, heads, groups, head_dim) in the float projection's output


def _check(out_features: int, segments: tuple[Segment, ...]) -> None:
    end = 0
    for start, heads, groups, head_dim in sorted(segments):
        if start < end or heads % groups or min(heads, groups, head_dim) < 1 or start + heads * head_dim > out_features:
            raise ValueError(f"bad grouped key/value segments {segments} for {out_features} output features")
        end = start + heads * head_dim


class GroupedKVLinear(nn.Module):
    """``nn.Linear`` whose key / value column segments hold fewer (grouped) heads, repeated on output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, segments: tuple[Segment, ...] | list[Any]
                 ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.segments: tuple[Segment, ...] = tuple(sorted((int(s[0]), int(s[1]), int(s[2]), int(s[3]))
                                                          for s in segments))
        _check(out_features, self.segments)
        stored = out_features - sum((h - g) * d for _, h, g, d in self.segments)
        self.weight = nn.Parameter(torch.empty(stored, in_features))
        self.bias = nn.Parameter(torch.empty(stored)) if bias else None

    def _pieces(self) -> list[tuple[int, int, int]]:
        """(stored width, repeat, head_dim) per column run of the stored weight; repeat 0 = kept as is."""
        pieces, col = [], 0
        for start, heads, groups, head_dim in self.segments:
            if start > col:
                pieces.append((start - col, 0, 0))
            pieces.append((groups * head_dim, heads // groups, head_dim))
            col = start + heads * head_dim
        if col < self.out_features:
            pieces.append((self.out_features - col, 0, 0))
        return pieces

    @classmethod
    def from_linear(cls, linear: nn.Linear, segments: tuple[Segment, ...]) -> GroupedKVLinear:
        """Mean-pool each segment's heads in groups of consecutive heads (weights and bias)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, segments)
        rows: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        col = 0
        with torch.no_grad():
            for start, heads, groups, head_dim in new.segments:
                rows.append(linear.weight[col:start])
                end = start + heads * head_dim
                w = linear.weight[start:end].reshape(groups, heads // groups, head_dim, -1).mean(1)
                rows.append(w.reshape(groups * head_dim, -1))
                if linear.bias is not None:
                    biases.append(linear.bias[col:start])
                    biases.append(linear.bias[start:end].reshape(groups, heads // groups, head_dim).mean(1).flatten())
                col = end
            rows.append(linear.weight[col:])
            new.weight = nn.Parameter(torch.cat(rows), requires_grad=linear.weight.requires_grad)
            if linear.bias is not None:
                biases.append(linear.bias[col:])
                new.bias = nn.Parameter(torch.cat(biases), requires_grad=linear.bias.requires_grad)
        return new.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        pieces = self._pieces()
        parts = y.split([w for w, _, _ in pieces], dim=-1)
        out = [p if repeat in (0, 1) else p.unflatten(-1, (-1, d)).repeat_interleave(repeat, dim=-2).flatten(-2)
               for p, (_, repeat, d) in zip(parts, pieces)]
        return out[0] if len(out) == 1 else torch.cat(out, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, segments={self.segments}"


def _config(m: GroupedKVLinear) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None,
            "segments": [v for s in m.segments for v in s]}  # flat: checkpoint configs hold lists of scalars


def _from_config(config: dict[str, Any]) -> GroupedKVLinear:
    flat = [int(v) for v in config["segments"]]
    if len(flat) % 4:
        raise ValueError(f"GroupedKVLinear segments hold 4 integers each, got {len(flat)}")
    segments = tuple((flat[i], flat[i + 1], flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4))
    return GroupedKVLinear(int(config["in_features"]), int(config["out_features"]), bool(config["bias"]), segments)


targets.register_module(GroupedKVLinear, _config, _from_config, name="fxforge.GroupedKVLinear",
                        keys=("in_features", "out_features", "bias", "segments"))
