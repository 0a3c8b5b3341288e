"""The one module-injection engine (PEFT's idea): swap selected call_module layers for new modules.

LoRA adapters, quantized layers and pruned layers are all "replace the module at this path with a
wrapper built from it". The node keeps its target, so the graph's structure, names and metadata stay;
only the module behind the node changes. The caller recompiles (the pass decorator does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..select import select_nodes

Builder = Callable[[str, nn.Module], nn.Module | None]


def describe_candidates(gm: fx.GraphModule, limit: int = 8) -> str:
    """A short list of the call_module layers a selector could name: 'Linear: a.b, c.d, ...'."""
    by_type: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            by_type.setdefault(type(gm.get_submodule(str(node.target))).__name__, []).append(str(node.target))
    parts = [f"{t} ({len(v)}): {', '.join(v[:3])}{', ...' if len(v) > 3 else ''}" for t, v in by_type.items()]
    return "; ".join(parts[:limit]) or "no call_module layers"


class NoMatchError(ValueError):
    """A selector matched no layer; the message lists what could have matched."""


@dataclass(frozen=True)
class Injection:
    """One replaced layer: where, what it was, what it is now."""

    name: str
    old_type: str
    new_type: str


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``path`` under ``root`` (parents must exist)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def inject_modules(gm: fx.GraphModule, targets: Any, exclude: Any, build: Builder,
                   what: str = "layer") -> list[Injection]:
    """Replace every selected call_module's module by ``build(name, module)`` (None = leave it).

    A module called from several nodes is replaced once. Raises NoMatchError when the selector
    matches nothing or every match was declined by ``build``.
    """
    done: dict[str, Injection] = {}
    for _, name, module, _ in list(select_nodes(gm, targets, exclude, modules_only=True)):
        if name in done or module is None:
            continue
        new = build(name, module)
        if new is None:
            continue
        set_module(gm, name, new)
        done[name] = Injection(name, type(module).__name__, type(new).__name__)
    if not done:
        raise NoMatchError(f"no {what} matched targets={targets!r} exclude={exclude!r}; "
                           f"candidates: {describe_candidates(gm)}")
    return list(done.values())
