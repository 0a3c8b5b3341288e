"""A shape guard deep enough for capture is loadable from its checkpoint: the loader's argument nesting limit
(graph/limits) leaves room for the deepest expression graph/guard_expr accepts, wrapped in the guard node's
kwargs (issue 27: tiny LeViT's guards on its stride-2 stages nest 15 deep, so its checkpoint saved but
refused to load)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import rehash_manifest, replace_expr_check

from fxforge import ForgeGraph
from fxforge.graph import guard_expr
from fxforge.graph.guards import GUARD_NODE, ShapeGuardError


class _Pyramid(torch.nn.Module):
    """Four stride-2 stages whose sizes are multiplied and re-divided (as LeViT's subsampling attention does),
    then a branch on the result: torch.export guards it with an 18-deep expression of the input's sizes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2], x.shape[-1]
        n = h * w
        for _ in range(4):
            h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
            n = h * w
            h = n // 4 + 1
            w = (h - 1) // 2 + 1
        if (x.shape[0] * n) % 4 == 1:
            return x * 2
        return x - 1


def _depth(tree: Any, steps: tuple[int, ...] = ()) -> int:
    """Nesting of an expression; a shared ``let`` program's by its expanded expression (its steps inlined)."""
    if not isinstance(tree, list | tuple):  # the graph holds programs as tuples (one constant in its code)
        return 0
    if tree[0] == "let":
        for step in tree[1:]:
            steps = (*steps, _depth(step, steps))
        return steps[-1]
    if tree[0] == "ref":
        return steps[tree[1]]
    return 1 + max((_depth(a, steps) for a in tree[1:]), default=0)


def test_a_deep_size_guard_round_trips_its_checkpoint(tmp_path: Path) -> None:
    model = _Pyramid()
    mg = ForgeGraph(model, torch.randn(2, 3, 64, 64)).eval()
    guard = next(n for n in mg.nodes if n.name == GUARD_NODE)
    deepest = max(_depth(c[3]) for c in guard.kwargs["checks"] if c[2] == "expr")
    assert deepest > 12, deepest  # deep enough to have overflowed the loader's old limit of 16 with its wrapping
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "pyramid"))
    for graph in (mg, loaded):
        for shape in ((3, 3, 32, 32), (1, 3, 40, 40)):  # the captured branch
            x = torch.randn(shape)
            assert torch.equal(graph(x), model(x)), shape
        for shape in ((1, 3, 64, 64), (3, 3, 24, 24)):  # the other branch: refused on the reloaded graph too
            with pytest.raises(ShapeGuardError):
                graph(torch.randn(shape))


def test_the_deepest_expression_capture_accepts_loads(tmp_path: Path) -> None:
    """A guard expression exactly as deep as graph/guard_expr allows fits the loader's nesting limit."""
    tree: list[Any] = ["dim", 0, 3]
    while _depth(tree) < guard_expr.MAX_DEPTH:
        tree = ["add", tree, ["int", 1]]
    tree = ["cmp", ">=", tree, ["int", 0]]
    guard_expr.validate(tree, 1)  # the grammar's own limit accepts it, one level more it refuses
    with pytest.raises(ValueError, match="deeper than"):
        guard_expr.validate(["not", tree], 1)
    path = ForgeGraph(_Pyramid(), torch.randn(2, 3, 64, 64)).eval().export(tmp_path / "pyramid")
    doc = json.loads((path / "graph.json").read_text())
    assert replace_expr_check(doc, tree)
    (path / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(path)
    loaded = ForgeGraph.from_checkpoint(path)
    x = torch.randn(3, 3, 32, 32)
    assert torch.equal(loaded(x), x - 1)

