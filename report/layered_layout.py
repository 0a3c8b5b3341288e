"""A layered (Sugiyama) layout of one level of the graph view: cycle removal, layer assignment, dummy nodes on
long edges, crossing reduction and coordinate assignment, computed in Python when the report is generated.

Each module group of the view is laid out on its own (its children: sub-modules drawn as boxes, and its own
nodes), so a page holds one small layout per group instead of one hairball. Coordinates are in slots (one
slot: one standard box plus its gap); the page's script turns them into pixels with the boxes' real sizes
(an expanded child is wider), keeping this module's layers, order and preferred centres.

Algorithms: cycle removal (a topological order, ties and cycles broken by graph order; edges against it are
reversed); longest-path layering pulled down to just above
the first user for sources (inputs, constants); median/barycentre sweeps down and up keeping the ordering with
the fewest crossings; priority-style coordinate assignment: alternating passes pull each item to the mean of
its neighbours' centres in the adjacent layer, then overlaps are resolved in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["LevelLayout", "layered_layout"]

DUMMY_WIDTH = 0.25  # a dummy (a long edge's bend point) takes a quarter slot
SWEEPS = 6


@dataclass
class LevelLayout:
    """``rows``: item ids per layer, top to bottom, in left-to-right order (dummies are ``~k``); ``x``: each
    id's preferred centre in slots; ``routes``: ``(src, dst, [dummies top to bottom])`` per edge."""

    rows: list[list[str]] = field(default_factory=list)
    x: dict[str, float] = field(default_factory=dict)
    routes: list[tuple[str, str, list[str]]] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"rows": self.rows, "x": {k: round(v, 3) for k, v in self.x.items()},
                "routes": [[s, d, bends] for s, d, bends in self.routes]}


def _layers(items: Sequence[str], edges: list[tuple[str, str]]) -> dict[str, int]:
    """Longest-path layers over the (acyclic) edges; sources sit right above their nearest user."""
    preds: dict[str, list[str]] = {i: [] for i in items}
    succs: dict[str, list[str]] = {i: [] for i in items}
    for s, d in edges:
        preds[d].append(s)
        succs[s].append(d)
    layer: dict[str, int] = {}
    for i in items:  # items are in topological order once back edges are reversed
        layer[i] = 1 + max((layer[p] for p in preds[i]), default=-1)
    for i in reversed(items):
        if not preds[i] and succs[i]:
            layer[i] = max(layer[i], min(layer[s] for s in succs[i]) - 1)
    return layer


def _crossings(upper: list[str], lower: list[str], down: dict[str, list[str]]) -> int:
    pos = {n: k for k, n in enumerate(lower)}
    pairs = [(a, pos[b]) for a, u in enumerate(upper) for b in down.get(u, []) if b in pos]
    return sum(1 for i, (a1, b1) in enumerate(pairs) for a2, b2 in pairs[i + 1:] if (a1 - a2) * (b1 - b2) < 0)


def _total_crossings(rows: list[list[str]], down: dict[str, list[str]]) -> int:
    return sum(_crossings(rows[k], rows[k + 1], down) for k in range(len(rows) - 1))


def _reorder(rows: list[list[str]], nbrs: dict[str, list[str]], fixed: int, moving: int) -> None:
    """Sort layer ``moving`` by the barycentre of each item's neighbours in layer ``fixed`` (stable)."""
    pos = {n: k for k, n in enumerate(rows[fixed])}
    keys = {}
    for k, n in enumerate(rows[moving]):
        ps = [pos[m] for m in nbrs.get(n, []) if m in pos]
        keys[n] = sum(ps) / len(ps) if ps else float(k)
    rows[moving].sort(key=lambda n: keys[n])


def _assign_x(rows: list[list[str]], up: dict[str, list[str]], down: dict[str, list[str]],
              width: dict[str, float]) -> dict[str, float]:
    """Centres in slots: pull towards neighbours' mean centre, then push apart in order (min gap = widths)."""
    x: dict[str, float] = {}
    for row in rows:
        left = 0.0
        for n in row:
            x[n] = left + width[n] / 2
            left += width[n]

    def settle(row: list[str], nbrs: dict[str, list[str]]) -> None:
        want = [sum(x[m] for m in nbrs[n]) / len(nbrs[n]) if nbrs.get(n) else x[n] for n in row]
        gap = [(width[row[k]] + width[row[k + 1]]) / 2 for k in range(len(row) - 1)]
        left, right = list(want), list(want)
        for k in range(1, len(row)):  # each as near its wish as the left neighbours allow
            left[k] = max(want[k], left[k - 1] + gap[k - 1])
        for k in range(len(row) - 2, -1, -1):  # ... and as the right neighbours allow
            right[k] = min(want[k], right[k + 1] - gap[k])
        for k, n in enumerate(row):  # both keep order and gaps, so their mean does too
            x[n] = (left[k] + right[k]) / 2

    for _ in range(4):
        for row in rows[1:]:
            settle(row, up)
        for row in reversed(rows[:-1]):
            settle(row, down)
    low = min(x[n] - width[n] / 2 for n in x) if x else 0.0
    return {n: v - low for n, v in x.items()}


def _topological(items: Sequence[str], edges: Sequence[tuple[str, str]]) -> list[str]:
    """``items`` in an order where edges point forward when they can (Kahn's algorithm, ties by the given
    order); on a cycle the waiting item with the fewest unplaced inputs goes next (its back edges get reversed)."""
    rank = {n: k for k, n in enumerate(items)}
    preds: dict[str, set[str]] = {n: set() for n in items}
    succs: dict[str, set[str]] = {n: set() for n in items}
    for s, d in edges:
        if s != d and s in rank and d in rank:
            preds[d].add(s)
            succs[s].add(d)
    waiting = {n: len(preds[n]) for n in items}
    ready = [n for n in items if waiting[n] == 0]
    out: list[str] = []
    while waiting:
        if not ready:
            ready = [min(waiting, key=lambda n: (waiting[n], rank[n]))]
        n = min(ready, key=rank.__getitem__)
        ready.remove(n)
        if n not in waiting:
            continue
        del waiting[n]
        out.append(n)
        for m in succs[n]:
            if m in waiting:
                waiting[m] -= 1
                if waiting[m] == 0:
                    ready.append(m)
    return out


def layered_layout(items: Sequence[str], edges: Sequence[tuple[str, str]]) -> LevelLayout:
    """Lay out ``items`` (in graph order) joined by ``edges`` (duplicates and self loops ignored)."""
    items = _topological(items, edges)
    order = {n: k for k, n in enumerate(items)}
    seen: set[tuple[str, str]] = set()
    forward: list[tuple[str, str]] = []
    flipped: list[bool] = []
    for s, d in edges:
        if s == d or s not in order or d not in order or (s, d) in seen:
            continue
        seen.add((s, d))
        flipped.append(order[s] > order[d])  # cycle removal: back edges (against graph order) reversed
        forward.append((d, s) if flipped[-1] else (s, d))
    layer = _layers(items, forward)
    rows: list[list[str]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for n in items:
        rows[layer[n]].append(n)
    width = {n: 1.0 for n in items}
    down: dict[str, list[str]] = {}
    up: dict[str, list[str]] = {}
    routes = []
    for k, (s, d) in enumerate(forward):
        chain, bends = s, []
        for lay in range(layer[s] + 1, layer[d]):  # one dummy per crossed layer
            dummy = f"~{k}.{lay}"
            rows[lay].append(dummy)
            width[dummy] = DUMMY_WIDTH
            down.setdefault(chain, []).append(dummy)
            up.setdefault(dummy, []).append(chain)
            bends.append(dummy)
            chain = dummy
        down.setdefault(chain, []).append(d)
        up.setdefault(d, []).append(chain)
        routes.append((d, s, bends[::-1]) if flipped[k] else (s, d, bends))
    best, best_count = [list(r) for r in rows], _total_crossings(rows, down)
    for sweep in range(SWEEPS):
        if sweep % 2 == 0:
            for k in range(1, len(rows)):
                _reorder(rows, up, k - 1, k)
        else:
            for k in range(len(rows) - 2, -1, -1):
                _reorder(rows, down, k + 1, k)
        count = _total_crossings(rows, down)
        if count < best_count:
            best, best_count = [list(r) for r in rows], count
    return LevelLayout(best, _assign_x(best, up, down, width), routes)
