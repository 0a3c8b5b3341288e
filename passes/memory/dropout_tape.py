"""DropoutTape: dropout inside a checkpointed region keeps its mask as bits, so recomputation does not redraw it.

A checkpoint replays dropout by restoring the CPU RNG state and drawing again; on CPU the draw (``bernoulli_``)
is most of what recomputing a dropout costs. Under the tape, the region's first run (the forward) draws each
``F.dropout`` noise exactly as aten's CPU dropout does (``empty_like(x).bernoulli_(1 - p)``, ``div_(1 - p)``,
``x * noise``) and keeps it packed to one bit per element (1/32 of a float input) with the RNG state after the
draw; a later run (the recomputation) unpacks it and sets that state, so the outputs, the gradients and every
later random op of the region (attention dropout, feature dropout) are bitwise those of the original graph.
``F.scaled_dot_product_attention`` with ``dropout_p > 0`` runs aten's math kernel on CPU, whose dropout draws
``bernoulli_`` on the attention weights (batch x heads x L x S: MiniLM 8x128's largest draw, ~8 ms per layer
here, redrawn by every recomputation); inside such a call the tape takes the draw itself at the dispatcher
(``bernoulli_`` with a float probability and the default generator), so that mask is kept as bits as well.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DropoutTape", "attention_dropout", "pack_bits", "unpack_bits"]

_BITS = 2 ** torch.arange(8, dtype=torch.uint8)  # bit k of a packed byte holds element 8i + k


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 tensor (any dtype, logical order) as one bit per element (uint8, zero-padded to whole bytes)."""
    flat = mask.reshape(-1).ne(0).to(torch.uint8)
    flat = F.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) * _BITS.to(flat.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The 0/1 tensor :func:`pack_bits` packed, shaped as ``like`` and of its dtype."""
    bits = packed.unsqueeze(-1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:like.numel()].view(like.shape).to(like.dtype)


def _dropout_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float, bool, bool]:
    """F.dropout's (input, p, training, inplace), however they were passed."""
    names, defaults = ("input", "p", "training", "inplace"), (None, 0.5, True, False)
    values: list[Any] = [kwargs.get(k, args[i] if i < len(args) else d)
                         for i, (k, d) in enumerate(zip(names, defaults))]
    return values[0], float(values[1]), bool(values[2]), bool(values[3])


class DropoutTape(TorchFunctionMode):
    """Records each CPU training-mode ``F.dropout`` of a run (noise bits + RNG state after it) and replays them,
    in order, on every later run: enter it around each run of the same region call, via :meth:`run`."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.position = 0

    def run(self, fn: Any, *args: Any) -> Any:
        """One run of ``fn`` under the tape: the first records, later ones replay from the first entry."""
        self.position = 0
        with self:
            return fn(*args)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, training, inplace = _dropout_args(args, kwargs)
            if training and not inplace and 0.0 < p < 1.0 and type(x) is torch.Tensor \
                    and x.device.type == "cpu" and x.numel() > 0:
                return self._dropout(x, p)
        if func is F.scaled_dot_product_attention and attention_dropout(args, kwargs):
            with _Draws(self):  # only this call's ops pass through the dispatcher-level tape
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def draw(self, noise: torch.Tensor, keep: float) -> torch.Tensor:
        """``noise.bernoulli_(keep)`` the first time, the kept bits (and the RNG state after) on later runs."""
        if self.position < len(self.entries):
            packed, state = self.entries[self.position]
            noise.copy_(unpack_bits(packed, noise))
            torch.set_rng_state(state)
        else:
            noise.bernoulli_(keep)
            self.entries.append((pack_bits(noise), torch.get_rng_state()))
        self.position += 1
        return noise

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if self.position < len(self.entries):  # recomputation: the kept mask, and the RNG where the draw left it
            packed, state = self.entries[self.position]
            noise = unpack_bits(packed, x)
            torch.set_rng_state(state)
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)  # aten's CPU dropout, draw for draw
            self.entries.append((pack_bits(noise), torch.get_rng_state()))
        self.position += 1
        noise.div_(1 - p)
        return x * noise


def attention_dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an F.scaled_dot_product_attention call drops out on CPU (its dropout_p > 0, its query a CPU tensor)."""
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    query = kwargs.get("query", args[0] if args else None)
    return isinstance(p, float | int) and 0.0 < p < 1.0 and type(query) is torch.Tensor and query.device.type == "cpu"


class _Draws(TorchDispatchMode):
    """Inside one attention call: each ``bernoulli_(p)`` on the default generator goes through the tape's draw."""

    def __init__(self, tape: DropoutTape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.bernoulli_.float and kwargs.get("generator") is None and len(args) >= 1 \
                and type(args[0]) is torch.Tensor and args[0].device.type == "cpu":
            return self.tape.draw(args[0], float(kwargs.get("p", args[1] if len(args) > 1 else 0.5)))
        return func(*args, **kwargs)
