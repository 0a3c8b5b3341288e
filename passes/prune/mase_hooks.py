"""MASE's pruning-hook passes, accepted as no-ops: fxforge's pruning installs no hooks.

MASE pruned through ``torch.nn.utils.parametrize`` on weights and forward pre-hooks on activations, so it
needed ``prune_detach_hook_transform_pass`` (remove them, baking the masks in) and
``hook_inspection_analysis_pass`` (list them). fxforge's masks are buffers of the masked layers, applied in
their forward (passes/prune/modules.py): there is nothing to detach, and the masked weights already export,
train and quantize as they are. Both passes leave the graph unchanged, say so in one logged line (and in
``info.notice``), and list any hooks a user registered on the Linear / Conv modules without touching them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import NoArgs, forge_pass
from ..contract import PassInfo

__all__ = ["HookPassInfo", "prune_detach_hook_analysis_pass", "hook_inspection_analysis_pass"]

_log = logging.getLogger(__name__)
NOTICE = ("{name}: nothing to do, fxforge's pruning has no hooks (masks are buffers applied in the masked "
          "layers' forward); the graph is unchanged")


@dataclass(frozen=True)
class HookPassInfo(PassInfo):
    """The one-line notice, and ``hooks``: ``"<module>_<kind>_<id>" -> hook function name`` for hooks found on
    Linear / Conv modules (user hooks; fxforge adds none); left in place."""

    notice: str
    hooks: dict[str, str] = field(default_factory=dict)


def _hooks(graph: ForgeGraph) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, m in graph.model.named_modules():
        if not isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
            continue
        for kind, table in (("forward", m._forward_hooks), ("forward_pre", m._forward_pre_hooks),
                            ("backward", m._backward_hooks)):
            for key, fn in table.items():
                out[f"{name}_{kind}_{key}"] = getattr(fn, "__name__", type(fn).__name__)
    return out


def _notice(name: str) -> str:
    text = NOTICE.format(name=name)
    _log.warning(text)
    return text


@forge_pass("analysis", NoArgs, info=HookPassInfo)
def prune_detach_hook_analysis_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, HookPassInfo]:
    """MASE's hook removal (its prune_detach_hook_transform_pass, which resolves here through passes/mase_names):
    a no-op (fxforge's masks are not hooks), so an analysis pass by fxforge's rule for pass kinds; one notice."""
    return graph, HookPassInfo(_notice("prune_detach_hook_analysis_pass"), _hooks(graph))


@forge_pass("analysis", NoArgs, info=HookPassInfo)
def hook_inspection_analysis_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, HookPassInfo]:
    """MASE's hook listing: fxforge installs none; lists user hooks on Linear / Conv modules; logs one notice."""
    return graph, HookPassInfo(_notice("hook_inspection_analysis_pass"), _hooks(graph))
