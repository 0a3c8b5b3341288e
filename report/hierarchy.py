"""The graph of a ForgeGraph grouped by module path: the nested structure the graph view draws (no HTML here).

API (reused by the report, notebooks' ``_repr_html_`` and the before/after page)::

    h = build_hierarchy(mg, sensitivity=None, sqnr=None)   # -> Hierarchy
    h.items["g:bert.encoder.layer.0"]                      # a ViewItem: group or node
    h.expanded                                             # the groups open by default
    h.to_json()                                            # what report/graph_view.py embeds in a page
    module_rows(h)                                         # one ModuleRow per module owning nodes (the table)

A node's module path is the innermost entry of the capture's ``nn_module_stack``, which checkpoints keep
(graph/checkpoint.py stores it per node, so a reloaded graph groups as the live one). A node without one (made
by a transform, or loaded from a checkpoint written before stacks were stored) is placed by inference: a
``call_module`` node at its target, a ``get_attr`` at its owner module, any other node at the deepest module
shared by its neighbours in graph order (the code runs inside the module that ran just before and just after
it; on a tiny BERT, inferring every node put 18 of 102, all at module boundaries, one level off the capture's
path). A module with one node is drawn as that node; a module with no nodes of its own and
a single sub-module is merged into it (``encoder.layer``). By default the root and every ancestor of a
numbered block list (``layer.0``, ``layer.1``...) are open while at most ``max_boxes`` (30) boxes show, so a
BERT opens on its embeddings, layers, pooler and classifier. Every group carries its nodes' overlay values
combined (report/overlays.py) and its own layered layout (report/layered_layout.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph
from ..graph.ir import classify
from ..graph.metadata import get_meta, has_meta
from .layered_layout import LevelLayout, layered_layout
from .overlays import OVERLAYS, node_precision, node_values, sensitivity_by_node

BUNDLE = 3
MAX_BOXES = 30

__all__ = ["Hierarchy", "ModuleRow", "ViewItem", "build_hierarchy", "module_paths", "module_rows", "module_types"]


@dataclass
class ViewItem:
    """A box of the view: a module group (``kind`` "group", id ``g:<path>``) or a graph node (``n:<name>``).
    ``path``: its module path (a node: the module whose code produced it); ``info``: text shown on expand."""

    id: str
    kind: str
    label: str
    path: str
    parent: str | None
    children: list[str] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    layout: LevelLayout | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "label": self.label, "path": self.path, "parent": self.parent,
                               "values": {k: float(f"{v:.6g}") for k, v in self.values.items()}, "info": self.info}
        if self.children:
            out["children"] = self.children
        if self.layout is not None:
            out["layout"] = self.layout.to_json()
        return out


@dataclass
class Hierarchy:
    """Every item by id, the root group's id, the graph's node edges and the groups open by default."""

    items: dict[str, ViewItem]
    root: str
    edges: list[tuple[str, str]]
    expanded: list[str]

    def groups(self) -> list[ViewItem]:
        return [i for i in self.items.values() if i.kind == "group"]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "expanded": self.expanded, "items": {k: v.to_json() for k, v in self.items.items()},
                "edges": self.edges, "overlays": [o.__dict__ for o in OVERLAYS]}


def _common(a: str | None, b: str | None) -> str:
    if a is None or b is None:
        return (a if b is None else b) or ""
    pa, pb = a.split("."), b.split(".")
    k = 0
    while k < min(len(pa), len(pb)) and pa[k] == pb[k]:
        k += 1
    return ".".join(pa[:k])


def module_paths(mg: ForgeGraph) -> dict[str, str]:
    """Node name -> module path ("" for the root: inputs, output, top-level code): the node's module stack
    (live or restored from a checkpoint), else inferred; see the module docstring."""
    known: dict[str, str | None] = {}
    for node in mg.nodes:
        stack = node.meta.get("nn_module_stack")
        path = str(list(stack.values())[-1][0]) if stack else None
        if path is not None and "nn_module_stack" in path:
            path = None  # torch's placeholder entry (_empty_nn_module_stack_from_metadata_hook) names no module
        if path is None and node.op == "call_module":
            path = str(node.target)
        elif path is None and node.op == "get_attr":
            path = str(node.target).rpartition(".")[0]
        elif node.op in ("placeholder", "output"):
            path = ""
        known[node.name] = path
    names = [n.name for n in mg.nodes]
    before: list[str | None] = []
    last: str | None = None
    for n in names:
        before.append(last)
        last = known[n] if known[n] is not None else last
    out, after = {}, None
    for k in range(len(names) - 1, -1, -1):
        n = names[k]
        found = known[n]
        out[n] = found if found is not None else _common(before[k], after)
        after = found if found is not None else after
    return out


def module_types(mg: ForgeGraph) -> dict[str, str]:
    """Module path -> class name, from every level of the module stacks (classes in a capture, class names in a
    reloaded checkpoint); for paths no stack names, the model's own submodule classes where they are not the
    plain containers a GraphModule rebuilds."""
    out: dict[str, str] = {}
    for node in mg.nodes:
        for path, typ in (node.meta.get("nn_module_stack") or {}).values():
            name = typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))
            out.setdefault(str(path), name.rpartition(".")[2])
    for path, module in mg.model.named_modules():
        if type(module) is not nn.Module and type(module).__name__ != "GraphModule":  # not a rebuilt container
            out.setdefault(path, type(module).__name__)
    return out


def _describe(node: fx.Node, root: nn.Module) -> dict[str, str]:
    try:
        kind, op = classify(node, root)
        kind_name = kind.value
    except Exception:  # noqa: BLE001 - a view must not fail on an unusual node
        kind_name, op = node.op, str(node.target)
    info = {"node": node.name, "op": op, "kind": kind_name, "target": str(node.target)[:120]}
    if has_meta(node):
        out = get_meta(node).common.results.get("data_out_0")
        if out is not None and out.type == "tensor":
            info["shape"] = str(list(out.shape or ()))
        module_type = get_meta(node).common.module_type
        if module_type:
            info["module"] = module_type.rpartition(".")[2]
    info["precision"] = node_precision(node)[0]
    return info


def _group_label(path: str, parent_path: str) -> str:
    rel = path[len(parent_path) + 1:] if parent_path else path
    if rel.isdigit() and parent_path:  # a numbered block: name it with its list (layer.0)
        return f"{parent_path.rpartition('.')[2]}.{rel}"
    return rel


def _combine(values: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ov in OVERLAYS:
        vs = [v[ov.key] for v in values if ov.key in v]
        if not vs:
            continue
        if ov.combine == "sum":
            out[ov.key] = sum(vs)
        elif ov.combine == "max":
            out[ov.key] = max(vs)
        elif ov.combine == "min":
            out[ov.key] = min(vs)
        else:  # weighted by the elements each value covers (sparsity over all weights)
            ns = [v.get(f"{ov.key}_n", 1.0) for v in values if ov.key in v]
            out[ov.key] = sum(a * n for a, n in zip(vs, ns, strict=True)) / max(sum(ns), 1.0)
            out[f"{ov.key}_n"] = sum(ns)
    return out


def _groups(paths: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str | None]]:
    """(node -> its group path, group path -> parent group path) after single-node modules become nodes and
    node-less single-child groups are merged into their child."""
    subtree: dict[str, int] = {}
    for path in paths.values():
        parts = path.split(".") if path else []
        for k in range(len(parts) + 1):
            key = ".".join(parts[:k])
            subtree[key] = subtree.get(key, 0) + 1
    groups = {p for p, c in subtree.items() if c >= 2} | {""}

    def owner(path: str) -> str:
        while path not in groups:
            path = path.rpartition(".")[0]
        return path

    home = {n: owner(p) for n, p in paths.items()}
    parent: dict[str, str | None] = {g: (None if g == "" else owner(g.rpartition(".")[0])) for g in groups}
    while True:
        owners = set(home.values())
        kids: dict[str, list[str]] = {}
        for g, p in parent.items():
            if p is not None:
                kids.setdefault(p, []).append(g)
        merge = next((g for g in parent if g and g not in owners and len(kids.get(g, [])) == 1), None)
        if merge is None:
            return home, parent
        child = kids[merge][0]
        parent[child] = parent.pop(merge)


def build_hierarchy(mg: ForgeGraph, sensitivity: Any = None, sqnr: Mapping[str, float] | None = None,
                    max_boxes: int = MAX_BOXES) -> Hierarchy:
    """The grouped view of ``mg``: ``sensitivity`` a SensitivityInfo (or ``{node: value}``), ``sqnr`` the SQNR (dB)
    per node name (report/rows.py measures it for quantized graphs); ``max_boxes``: the default view opens the
    block lists' ancestors only while at most this many boxes show (the root always opens)."""
    root = mg.model
    paths = module_paths(mg)
    home, parent = _groups(paths)
    sens, sqnr = sensitivity_by_node(sensitivity), dict(sqnr or {})
    items: dict[str, ViewItem] = {}
    gid = {g: f"g:{g}" for g in parent}
    types = module_types(mg)
    for g, p in parent.items():
        label = _group_label(g, p or "") if p is not None else "model"
        kind = types.get(g, "")
        items[gid[g]] = ViewItem(gid[g], "group", label, g, None if p is None else gid[p], info={"module": kind})
    edges: list[tuple[str, str]] = []
    for node in mg.nodes:
        nid = f"n:{node.name}"
        path, g = paths[node.name], home[node.name]
        values = node_values(node, root)
        if node.name in sqnr:
            values["sqnr_db"] = float(sqnr[node.name])
        key = str(node.target) if node.op == "call_module" and node.name not in sens else node.name
        if key in sens:  # sensitivity_analysis_pass names a layer by its module path, as selectors do
            values["sensitivity"] = sens[key]
        label = path[len(g) + 1:] if path != g and g else (path if path != g else node.name)
        items[nid] = ViewItem(nid, "node", label, path, gid[g], values=values, info=_describe(node, root))
        items[gid[g]].children.append(nid)
        edges.extend((f"n:{p.name}", nid) for p in node.all_input_nodes)
    first: dict[str, int] = {}  # each group's first node in graph order (filled by _finish)
    for g, p in parent.items():
        if p is not None:
            items[gid[p]].children.append(gid[g])
    _bundle_ops(items, [n.name for n in mg.nodes])
    _finish(items, gid[""], edges, first)
    blocks = {i.parent for i in items.values() if i.kind == "group" and i.path.rpartition(".")[2].isdigit()}
    expanded = {gid[""]}
    for b in blocks:
        while b is not None:
            expanded.add(b)
            b = items[b].parent
    depth = {i: i.count(".") + i.count("#") for i in expanded}
    while _visible(items, gid[""], expanded) > max_boxes and len(expanded) > 1:  # readable first: close the deepest
        expanded.discard(max(expanded - {gid[""]}, key=lambda i: (depth[i], first[i])))
    return Hierarchy(items, gid[""], edges, sorted(expanded, key=lambda i: first[i]))


def _visible(items: Mapping[str, ViewItem], root: str, expanded: set[str]) -> int:
    """How many boxes (closed groups and nodes) show when ``expanded`` groups are open."""
    count, stack = 0, [root]
    while stack:
        for c in items[stack.pop()].children:
            if c in expanded:
                stack.append(c)
            else:
                count += 1
    return count


def _bundle_ops(items: dict[str, ViewItem], order: list[str]) -> None:
    """In a group with sub-modules, each run of >= BUNDLE of its own code's nodes (consecutive among its
    children in graph order: mask building, shape guards) becomes one box ``N ops`` that opens like a module."""
    position = {f"n:{n}": k for k, n in enumerate(order)}
    for group in [i for i in items.values() if i.kind == "group"]:
        if not any(items[c].kind == "group" for c in group.children):
            continue
        def start(c: str) -> int:
            return position[c] if c in position else min(start(k) for k in items[c].children)
        kids = sorted(group.children, key=start)
        runs: list[list[str]] = [[]]
        for c in kids:
            glue = items[c].kind == "node" and items[c].info["kind"] not in ("placeholder", "output") \
                and items[c].path == group.path
            if glue:
                runs[-1].append(c)
            elif runs[-1]:
                runs.append([])
        for k, run in enumerate(r for r in runs if len(r) >= BUNDLE):
            bid = f"{group.id}#ops{k}"
            items[bid] = ViewItem(bid, "group", f"{len(run)} ops", group.path, group.id, children=list(run),
                                  info={"module": "code of " + (group.label if group.parent else "the model")})
            for c in run:
                items[c].parent = bid
            group.children = [c for c in group.children if c not in set(run)] + [bid]


def _finish(items: dict[str, ViewItem], root: str, edges: list[tuple[str, str]], first: dict[str, int]) -> None:
    """Order children by their first node, combine values bottom-up and lay out every group."""
    order = {i: k for k, i in enumerate(i for i in items if items[i].kind == "node")}

    def visit(gid: str) -> tuple[int, list[dict[str, float]]]:
        group, leaves, starts = items[gid], [], {}
        for c in group.children:
            if items[c].kind == "group":
                starts[c], vals = visit(c)
            else:
                starts[c], vals = order[c], [items[c].values]
            leaves.extend(vals)
        group.children.sort(key=lambda c: starts[c])
        group.values = _combine(leaves)
        group.info["nodes"] = str(len(leaves))
        first[gid] = min(starts.values(), default=len(order))
        return first[gid], leaves

    visit(root)
    chain: dict[str, list[str]] = {}
    for i in items:
        up: str | None = i
        seq: list[str] = []
        while up is not None:
            seq.append(up)
            up = items[up].parent
        chain[i] = seq[::-1]
    level_edges: dict[str, list[tuple[str, str]]] = {}
    for s, d in edges:
        cs, cd = chain[s], chain[d]
        k = 0
        while k < min(len(cs), len(cd)) and cs[k] == cd[k]:
            k += 1
        level_edges.setdefault(cs[k - 1], []).append((cs[k], cd[k]))
    for item in items.values():
        if item.kind == "group":
            item.layout = layered_layout(item.children, level_edges.get(item.id, []))


@dataclass(frozen=True)
class ModuleRow:
    """One row of the per-module table: a module path owning nodes, its type, combined values and node ids."""

    path: str
    module: str
    values: dict[str, float]
    nodes: tuple[str, ...]


def module_rows(h: Hierarchy) -> list[ModuleRow]:
    """One row per module whose code produced nodes (a layer: ``...attention.self.query``), in graph order."""
    by_path: dict[str, list[ViewItem]] = {}
    for item in h.items.values():
        if item.kind == "node":
            by_path.setdefault(item.path, []).append(item)
    rows = []
    for path, nodes in by_path.items():
        module = next((n.info["module"] for n in nodes if n.info.get("module")), "")
        group = h.items.get(f"g:{path}")
        rows.append(ModuleRow(path or "(model)", module or (group.info["module"] if group else ""),
                              _combine([n.values for n in nodes]), tuple(n.id for n in nodes)))
    return rows
