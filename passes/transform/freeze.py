"""Freeze or unfreeze parameters by selector (the one selector language of passes/select).

Freezing works on the **module tree**, not only on graph nodes: a selector is matched against every
named module of ``graph.model`` (name = module path, op = canonical op of the module) and a selected
module has all its parameters, recursively, frozen. So ``{"name": "embeddings"}`` freezes the whole
``bert.embeddings`` block (word/position/type embeddings and its LayerNorm), ``{"type": "embedding"}``
only the embedding tables, ``{"regex": r"bert\\.encoder\\.layer\\.[0-2]\\..*"}`` the first three layers.

Note that a captured graph shares its leaf layers (and so their Parameter objects) with the captured
model: freezing a layer of the graph freezes it in that model too, as PEFT does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import NoMatchError, param_users, refresh_nodes
from ..select import Selector, parse_selector_fields, select_modules


@dataclass(frozen=True)
class FreezeInfo(PassInfo):
    """modules: the selected module paths; parameters: parameter elements whose flag was set."""

    modules: list[str] = field(default_factory=list)
    parameters: int = 0


_UNCHANGED = NumericalContract("exact", atol=0.0, rtol=0.0, note="only requires_grad flags change")


def set_requires_grad(root: nn.Module, targets: Any, exclude: Any = None, requires_grad: bool = False,
                      what: str = "module") -> FreezeInfo:
    """Set ``requires_grad`` on every parameter of the selected modules; NoMatchError if none has any.

    Returns the module paths and the number of parameter elements touched.
    """
    if Selector.parse(targets).empty:
        raise NoMatchError(f"an empty selector selects no {what}: give e.g. {{'name': 'embeddings'}}")
    chosen = [(path, m) for path, m in select_modules(root, targets, exclude)
              if any(True for _ in m.parameters())]
    if not chosen:
        paths = [p for p, m in root.named_modules() if p and any(True for _ in m.parameters(recurse=False))]
        more = ", ..." if len(paths) > 6 else ""
        raise NoMatchError(f"no {what} with parameters matched targets={targets!r} exclude={exclude!r}; "
                           f"modules with parameters include: {', '.join(paths[:6])}{more}")
    seen: set[int] = set()
    count = 0
    for _, module in chosen:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                p.requires_grad_(requires_grad)
                count += p.numel()
    return FreezeInfo(modules=[p for p, _ in chosen], parameters=count)


@dataclass(frozen=True)
class FreezeArgs:
    """targets: the modules to (un)freeze (selector, required); exclude: modules to leave as they are."""

    targets: Any = None
    exclude: Any = None

    def __post_init__(self) -> None:
        if self.targets is None:
            raise ValueError("'targets' is required: a selector such as {'name': 'embeddings'} or "
                             "{'type': 'embedding'}")
        parse_selector_fields(self)


def _set_and_refresh(graph: ForgeGraph, args: FreezeArgs, requires_grad: bool) -> FreezeInfo:
    info = set_requires_grad(graph.model, args.targets, args.exclude, requires_grad=requires_grad)
    refresh_nodes(graph.model, param_users(graph.model))  # parameter metadata records requires_grad
    return info


@forge_pass("transform", FreezeArgs, info=FreezeInfo, contract=_UNCHANGED)
def freeze_transform_pass(graph: ForgeGraph, args: FreezeArgs) -> tuple[ForgeGraph, FreezeInfo]:
    """Freeze (requires_grad=False) every parameter of the selected modules; outputs are unchanged."""
    return graph, _set_and_refresh(graph, args, requires_grad=False)


@forge_pass("transform", FreezeArgs, info=FreezeInfo, contract=_UNCHANGED)
def unfreeze_transform_pass(graph: ForgeGraph, args: FreezeArgs) -> tuple[ForgeGraph, FreezeInfo]:
    """Make every parameter of the selected modules trainable again (requires_grad=True)."""
    return graph, _set_and_refresh(graph, args, requires_grad=True)
