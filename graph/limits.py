"""Every size limit a checkpoint reader enforces, in one place (the README's security section lists them).

Real graphs fit with a wide margin: the largest graph the tests capture (tiny T5 through torch.export)
has 391 nodes and 525 edges, and its arguments nest at most 7 deep; an 80-layer Llama is about
8,000 nodes. The limits bound how long a hostile checkpoint can keep the loader busy before any module,
tensor or node is built (200,000 trivial nodes took a minute to load before they existed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .guard_expr import MAX_DEPTH as MAX_GUARD_EXPR_DEPTH
from .targets import CheckpointError

__all__ = ["GraphSize", "check_graph_size"]

MAX_JSON_BYTES = 256 * 2**20  # one JSON file of a checkpoint (graph.json, metadata.json, adapter configs)
MAX_MANIFEST_BYTES = 2**20  # manifest.json (read before any hash can be checked)
MAX_JSON_DEPTH = 64  # bracket nesting of any JSON file, checked before parsing
MAX_NODES = 50_000  # nodes of one graph
MAX_EDGES = 200_000  # node references in all nodes' arguments (the graph's edges, repeats counted)
# JSON nesting of one node's arguments (lists, tuples, dicts, slices inside each other). The deepest are shape
# guards: an expression graph/guard_expr accepts (MAX_GUARD_EXPR_DEPTH + 1 lists) inside the guard node's kwargs
# (dict, checks tuple, check tuple: 5 more), so a guard capture keeps always loads (LeViT's nest 20 deep).
MAX_ARG_DEPTH = MAX_GUARD_EXPR_DEPTH + 8
MAX_ARG_ELEMENTS = 1_000_000  # JSON values in all nodes' arguments together
MAX_MODULES = 50_000  # entries of the module tree (and module aliases)
MAX_TENSORS = 50_000  # parameters, buffers and constants (and their aliases)
MAX_MODULE_STACK = 64  # entries of one node's module stack (graph/checkpoint_values.check_module_stack)
MAX_STACK_PATH_CHARS = 1024  # characters of one module path in a node's module stack
MAX_CLASS_NAME_CHARS = 128  # characters of one class name in a node's module stack


@dataclass(frozen=True)
class GraphSize:
    """What :func:`check_graph_size` counted in a graph document."""

    nodes: int
    edges: int
    arg_depth: int
    arg_elements: int
    modules: int
    tensors: int


def _measure(value: Any) -> tuple[int, int, int]:
    """(node references, nesting depth, JSON values) of one node's arguments, without recursion."""
    edges = deepest = elements = 0
    stack: list[tuple[Any, int]] = [(value, 1 if isinstance(value, list | dict) else 0)]
    while stack:
        item, depth = stack.pop()
        elements += 1
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            edges += item.get("$") == "node"
            stack.extend((v, depth + 1 if isinstance(v, list | dict) else depth) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1 if isinstance(v, list | dict) else depth) for v in item)
    return edges, deepest, elements


def _length(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    return len(value) if isinstance(value, list | dict) else 0


def check_graph_size(doc: Any, where: str) -> GraphSize:
    """Count a parsed graph document's nodes, edges, argument nesting and elements, modules and tensors;
    CheckpointError naming ``where`` and the field when any is over its limit. Linear in the document."""
    if not isinstance(doc, dict):
        return GraphSize(0, 0, 0, 0, 0, 0)
    listed = doc.get("nodes")
    nodes: list[Any] = listed if isinstance(listed, list) else []
    modules = _length(doc, "modules") + _length(doc, "module_aliases")
    for field, count, limit in (("nodes", len(nodes), MAX_NODES), ("modules", modules, MAX_MODULES),
                                ("tensors", _length(doc, "tensors"), MAX_TENSORS)):
        if count > limit:
            raise CheckpointError(f"{where}: '{field}' holds {count} entries (at most {limit} allowed)")
    edges = deepest = elements = 0
    for i, entry in enumerate(nodes):
        if not isinstance(entry, dict):
            continue
        for field in ("args", "kwargs"):
            e, d, n = _measure(entry.get(field))
            if d > MAX_ARG_DEPTH:
                raise CheckpointError(f"{where}: nodes[{i}] ({str(entry.get('name'))[:60]!r}) {field} nested {d} "
                                      f"deep (at most {MAX_ARG_DEPTH} allowed)")
            edges, deepest, elements = edges + e, max(deepest, d), elements + n
        if edges > MAX_EDGES:
            raise CheckpointError(f"{where}: the nodes' arguments reference other nodes more than {MAX_EDGES} "
                                  "times (at most that many edges allowed)")
        if elements > MAX_ARG_ELEMENTS:
            raise CheckpointError(f"{where}: the nodes' arguments hold more than {MAX_ARG_ELEMENTS} values "
                                  "(at most that many allowed)")
    return GraphSize(len(nodes), edges, deepest, elements, modules, _length(doc, "tensors"))
