"""Online Hadamard rotation of selected linears' inputs: any model, post-LN BERT / MiniLM included.

For each selected ``nn.Linear`` (in_features n) the weight becomes W·H and a :class:`HadamardRotation` computing
x·H is inserted on its input (H orthonormal: (x·H)·(W·H)ᵀ = x·Wᵀ). Outputs are unchanged up to fp32 rounding;
the weight's outlier input columns are spread over the whole block, so its rows quantize with smaller scales
(GPTQ / round-to-nearest afterwards). Linears reading the same value share one rotation node.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..rewrite import GraphRewrite
from ..select import select_nodes
from .hadamard import HadamardRotation, hadamard_matrix

__all__ = ["rotate_online"]


def _free_path(gm: fx.GraphModule, path: str) -> str:
    taken = {name for name, _ in gm.named_modules()}
    candidate, i = f"{path}_hadamard", 1
    while candidate in taken:
        candidate, i = f"{path}_hadamard_{i}", i + 1
    return candidate


@torch.no_grad()
def rotate_online(gm: fx.GraphModule, targets: Any, exclude: Any) -> tuple[list[str], list[str], dict[str, str], bool]:
    """Rotate the inputs of the selected linears. Returns (linears rotated, rotation modules inserted, selected
    layers left as they are with the reason, whether a tied weight was untied)."""
    skipped: dict[str, str] = {}
    calls: dict[str, list[fx.Node]] = {}
    for node, name, module, _ in select_nodes(gm, targets, exclude):
        if node.op != "call_module" or type(module) is not nn.Linear:
            skipped[name] = (f"a {type(module).__name__ if module is not None else node.op}, not an nn.Linear "
                             "(rotate before quantizing, pruning or adding LoRA)")
        elif len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            skipped[name] = "called with other arguments than one tensor"
        else:
            calls.setdefault(name, []).append(node)
    for path in list(calls):  # a layer called elsewhere unselected would get an unrotated input there
        if sum(n.op == "call_module" and n.target == path for n in gm.graph.nodes) != len(calls[path]):
            skipped[path] = "also called where the selector does not reach"
            del calls[path]
    owners: dict[int, int] = {}
    for m in gm.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    untied = any(owners[id(gm.get_submodule(path).weight)] > 1 for path in calls)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rotations: dict[tuple[fx.Node, int], fx.Node] = {}
    inserted: list[str] = []
    with GraphRewrite(gm) as rw:
        for path, nodes in calls.items():
            lin = gm.get_submodule(path)
            assert isinstance(lin, nn.Linear)
            n = lin.in_features
            h, _ = hadamard_matrix(n)
            w = lin.weight
            lin.weight = nn.Parameter((w.double() @ h.to(w.device)).to(w.dtype), requires_grad=w.requires_grad)
            for call in nodes:
                x = call.args[0]
                assert isinstance(x, fx.Node)
                key = (x, n)
                if key not in rotations:
                    first = min((u for u in x.users if u in order), key=order.__getitem__)
                    new_path = _free_path(gm, path)
                    rotations[key] = rw.call_module(new_path, HadamardRotation(n).to(w.device), (x,), before=first)
                    inserted.append(new_path)
                rw.set_arg(call, 0, rotations[key])
    return list(calls), inserted, skipped, untied
