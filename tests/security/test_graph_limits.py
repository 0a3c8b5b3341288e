"""Graph size is bounded before anything is built: nodes, edges, argument nesting and elements, modules and
tensors, by the documented limits of graph/limits.py (200,000 trivial nodes took a minute to load), and
real graphs fit them with room to spare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from security_helpers import edit_json, export_zoo_gpt, fresh_copy

from fxforge import CheckpointError, ForgeGraph
from fxforge.graph import limits
from fxforge.models.zoo import build


@pytest.fixture(scope="module")
def zoo_gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_zoo_gpt(tmp_path_factory, "export")


@pytest.fixture
def ckpt(zoo_gpt: Path, tmp_path: Path) -> Path:
    return fresh_copy(zoo_gpt, tmp_path)


def _add_nodes(path: Path, nodes: list[dict[str, Any]]) -> None:
    def edit(g: dict[str, Any]) -> None:
        first = next(i for i, n in enumerate(g["nodes"]) if n["op"] != "placeholder")
        g["nodes"][first:first] = nodes
    edit_json(path, "graph.json", edit)


def _refused(path: Path, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused naming graph.json, before a single module is built."""
    built: list[Any] = []
    monkeypatch.setattr("fxforge.graph.checkpoint_load._build_modules", lambda *a: built.append(a))
    with pytest.raises(CheckpointError, match=rf"graph\.json: {match}"):
        ForgeGraph.from_checkpoint(path)
    assert not built


def test_too_many_nodes(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _add_nodes(ckpt, [{"name": f"n{i}", "op": "call_function", "target": "operator.add", "args": [i, 1],
                       "kwargs": {}} for i in range(limits.MAX_NODES)])
    _refused(ckpt, rf"'nodes' holds \d+ entries \(at most {limits.MAX_NODES} allowed\)",
             monkeypatch)


def test_too_many_edges(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    idx = {"$": "node", "name": "idx"}
    many = [{"name": f"c{i}", "op": "call_function", "target": "torch.cat", "args": [[idx] * 10_000],
             "kwargs": {}} for i in range(limits.MAX_EDGES // 10_000 + 1)]
    _add_nodes(ckpt, many)
    _refused(ckpt, rf"the nodes' arguments reference other nodes more than {limits.MAX_EDGES} times", monkeypatch)


def test_too_deeply_nested_argument(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    value: Any = 1
    for _ in range(limits.MAX_ARG_DEPTH):
        value = [value]
    _add_nodes(ckpt, [{"name": "deep", "op": "call_function", "target": "operator.add", "args": [value, 1],
                       "kwargs": {}}])
    depth = limits.MAX_ARG_DEPTH
    _refused(ckpt, rf"nodes\[\d+\] \('deep'\) args nested {depth + 1} deep \(at most {depth}", monkeypatch)


def test_too_many_argument_values(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _add_nodes(ckpt, [{"name": "wide", "op": "call_function", "target": "torch.tensor",
                       "args": [list(range(limits.MAX_ARG_ELEMENTS))], "kwargs": {}}])
    _refused(ckpt, rf"the nodes' arguments hold more than {limits.MAX_ARG_ELEMENTS} values", monkeypatch)


@pytest.mark.parametrize("field,limit", [("modules", limits.MAX_MODULES), ("tensors", limits.MAX_TENSORS)])
def test_too_many_modules_or_tensors(ckpt: Path, monkeypatch: pytest.MonkeyPatch, field: str, limit: int) -> None:
    entry = {"modules": {"path": "extra", "class": "torch.nn.Identity", "config": {}},
             "tensors": {"name": "extra", "kind": "constant"}}[field]
    edit_json(ckpt, "graph.json", lambda g: g[field].extend([entry] * limit))
    _refused(ckpt, rf"'{field}' holds \d+ entries \(at most {limit} allowed\)", monkeypatch)


def test_real_graphs_fit_the_limits_tenfold(zoo_gpt: Path, tmp_path: Path) -> None:
    """The zoo's GPT, AGRU and MiniLM (fx and export captures) use under a tenth of every limit."""
    paths = [zoo_gpt]
    for name, frontend in (("gpt", "fx"), ("agru", "export"), ("minilm", "export")):
        zm = build(name)
        paths.append(ForgeGraph(zm.model, frontend=frontend, **zm.capture).export(tmp_path / f"{name}_{frontend}"))
    sizes = [limits.check_graph_size(json.loads((p / "graph.json").read_text()), str(p)) for p in paths]
    assert max(s.nodes for s in sizes) >= 200  # MiniLM: a real 6-layer transformer
    for s in sizes:
        assert 10 * s.nodes <= limits.MAX_NODES and 10 * s.edges <= limits.MAX_EDGES
        assert 2 * s.arg_depth <= limits.MAX_ARG_DEPTH and 10 * s.arg_elements <= limits.MAX_ARG_ELEMENTS
        assert 10 * s.modules <= limits.MAX_MODULES and 10 * s.tensors <= limits.MAX_TENSORS
