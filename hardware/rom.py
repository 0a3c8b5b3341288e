"""ROM initialisation files for ``$readmemh``: one hex word per line, lanes packed low element first."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["pack_words", "write_mem", "linear_weight_lanes", "linear_bias_lanes"]


def pack_words(lanes: torch.Tensor, width: int) -> list[str]:
    """Each row of ``lanes`` (rows, n) as one hex word: element k in bits ``[k*width +: width]`` (two's complement)."""
    mask = (1 << width) - 1
    digits = max(1, (lanes.shape[1] * width + 3) // 4)
    words = []
    for row in lanes.tolist():
        word = 0
        for k, value in enumerate(row):
            word |= (int(value) & mask) << (k * width)
        words.append(f"{word:0{digits}x}")
    return words


def write_mem(path: Path, lanes: torch.Tensor, width: int) -> None:
    """Write ``lanes`` (rows, n) as a ``$readmemh`` file of ``rows`` words."""
    path.write_text("\n".join(pack_words(lanes, width)) + "\n")


def linear_weight_lanes(weight: torch.Tensor, p_in: int, p_out: int) -> torch.Tensor:
    """(out, in) integers as (blocks * beats, p_out * p_in): word (block, beat) holds W[block*p_out + j,
    beat*p_in + i] at lane ``j * p_in + i`` (fixed_linear.sv reads it so)."""
    out_f, in_f = weight.shape
    w = weight.reshape(out_f // p_out, p_out, in_f // p_in, p_in)  # block, j, beat, i
    return w.permute(0, 2, 1, 3).reshape(-1, p_out * p_in)


def linear_bias_lanes(bias: torch.Tensor, p_out: int) -> torch.Tensor:
    """(out,) integers as (blocks, p_out)."""
    return bias.reshape(-1, p_out)
