"""Feed-forward units from the dependency groups: plain (one row of ``fc1``) or gated (a row of each of
``gate_proj`` and ``up_proj``, joined by the SwiGLU product), read back by the next Linear's columns.

A class of the dependency graph is an FFN unit when it is not an attention head, nothing pins it, it
holds at most one row of each producer layer, and its columns feed Linears back to the producers' input
width. Its rows are masked (and later removed by the shrink) together.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn

from .groups import DependencyGraph, GroupError
from .modules import PrunableLayer

__all__ = ["ffn_layers", "ffn_units"]

Unit = tuple[str, list[tuple[str, int]]]


def _why_not(dep: DependencyGraph, path: str, layer: nn.Module, modules: dict[str, nn.Module],
             classes: dict[int, list[int]], heads: dict[int, tuple[str, int]]) -> tuple[str, tuple[str, ...]]:
    """('' and the layers whose rows form each unit with this layer's) or (why not, ())."""
    units = [u for u, (p, _) in enumerate(dep.units) if p == path]
    if not units:
        return "its output is not an FFN unit (not a Linear output the graph analysis follows)", ()
    partners: set[tuple[str, ...]] = set()
    for u in units:
        root = dep.find(u)
        if root in heads:
            return f"its rows belong to attention heads ({heads[root][0]})", ()
        if dep.pinned(root):
            return f"its rows cannot be removed: {dep.pinned(root)}", ()
        producers = [dep.units[m][0] for m in classes[root]]
        if len(set(producers)) != len(producers):
            return "its rows are tied to other rows of one layer (not independent FFN units)", ()
        partners.add(tuple(sorted(producers)))
    if len(partners) != 1:
        return "its rows are tied to rows of different layers (not independent FFN units)", ()
    roots = {dep.find(x) for x in units}
    consumers = [c for c, cols in dep.columns.items() if any(dep.find(v) in roots for v in cols.values())]
    widths = {getattr(modules[c], "out_features", None) for c in consumers}
    if widths != {getattr(layer, "in_features", None)}:
        return "its units do not feed a Linear back to the layer's input width (not a feed-forward block)", ()
    return "", partners.pop()


def ffn_layers(dep: DependencyGraph, layers: Mapping[str, nn.Module],
               modules: dict[str, nn.Module]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """path -> ('', producer layers of its units) when its rows are FFN units, else (why not, ())."""
    classes, heads = dep.classes(), dep.head_of()
    return {path: _why_not(dep, path, layer, modules, classes, heads) for path, layer in layers.items()}


def ffn_units(dep: DependencyGraph, layers: Mapping[str, PrunableLayer], modules: dict[str, nn.Module],
              explicit: bool) -> tuple[dict[str, PrunableLayer], list[Unit]]:
    """The selected layers carrying FFN units and the units (group key: the block's first producer layer;
    rows cut together); an error names a selected layer without units (explicit selection) or a gated
    partner left out of the selection."""
    why = ffn_layers(dep, layers, modules)
    ok = [p for p, (w, _) in why.items() if not w]
    bad = {p: w for p, (w, _) in why.items() if w}
    if explicit and bad:
        p, w = next(iter(bad.items()))
        raise GroupError(f"ffn pruning: layer {p!r} has no FFN units: {w}; layers with FFN units: {ok}")
    if not ok:
        reasons = "; ".join(f"{p}: {w}" for p, w in list(bad.items())[:3])
        raise GroupError(f"ffn pruning: no selected layer has FFN units ({reasons})")
    for p in ok:
        missing = [q for q in why[p][1] if q not in layers]
        if missing:
            raise GroupError(f"ffn pruning: the FFN units of {p!r} are rows of {list(why[p][1])} together (a gated "
                             f"MLP): layers {missing} must be selected too")
    classes = dep.classes()
    units: list[Unit] = []
    seen: set[int] = set()
    for path in ok:
        for r in range(layers[path].weight.shape[0]):
            root = dep.root(path, r)
            if root not in seen:
                seen.add(root)
                rows = sorted(dep.units[m] for m in classes[root])
                units.append((rows[0][0], rows))
    return {p: layers[p] for p in ok}, units
