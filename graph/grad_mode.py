"""Grad-mode switches during capture: torch.fx cannot record them, torch.export records them as regions.

``torch.fx`` symbolic tracing runs ``with torch.no_grad():`` / ``torch.enable_grad()`` /
``@torch.no_grad()`` at trace time and records none of it, so the traced graph would compute gradients
the module does not (parameters under ``no_grad`` would train). :func:`refuse_grad_mode_switches` makes
such a switch fail the fx trace instead (``capture`` then falls back to export, which keeps the regions
and normalisation inlines them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["GRAD_MODE_HINT", "GradModeSwitchError", "refuse_grad_mode_switches"]

GRAD_MODE_HINT = ("torch.fx cannot keep grad-mode regions: use frontend='export' (it keeps them), or list the "
                  "module that switches grad mode in leaf_modules (fx frontend)")


class GradModeSwitchError(RuntimeError):
    """The forward switched grad mode while torch.fx traced it."""


@contextmanager
def refuse_grad_mode_switches() -> Iterator[None]:
    """Within the block, a grad-mode switch on this thread raises :class:`GradModeSwitchError`.

    Patches ``torch._C._set_grad_enabled`` (what ``no_grad``, ``enable_grad`` and ``set_grad_enabled``
    call); other threads get the original.
    """
    original = torch._C._set_grad_enabled
    owner = threading.get_ident()

    def switch(enabled: bool, *args: Any, **kwargs: Any) -> Any:  # torch's parameter name, so it type-checks
        if threading.get_ident() == owner:
            raise GradModeSwitchError(
                f"the forward switches grad mode (torch.set_grad_enabled({bool(enabled)}), e.g. torch.no_grad() or "
                "torch.enable_grad()), which a torch.fx trace would silently drop")
        return original(enabled, *args, **kwargs)

    torch._C._set_grad_enabled = switch
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original
