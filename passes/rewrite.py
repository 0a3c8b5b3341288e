"""The one rewrite engine: module swaps and graph rewrites that keep node metadata true.

Every transform that changes what a node computes goes through here, so no pass refreshes metadata
by hand. Two entry points:

* **Module swaps** (PEFT's idea: LoRA adapters, quantized / lowered / pruned layers)::

      done = inject_modules(gm, targets, exclude, build)       # select -> build -> set -> refresh
      swap_module(gm, "encoder.0.fc", new_module)              # one path, no selector

  The node keeps its name and target; its identity (kind, op, module_type) and values (parameters,
  result shapes) are re-derived; software/hardware records stay.

* **Graph rewrites** (remove dropout, quantizer insertion, CSE, folding, fusion)::

      with GraphRewrite(gm) as rw:
          q = rw.call_module("quant.x", Quantize(...), (x,), before=node)   # new node
          w = rw.get_attr("fc.weight", before=node)                          # read a parameter / buffer
          rw.set_arg(node, 0, q)                                             # rewire an input
          rw.set_args(node, (x, 4, 8))                                       # all of a node's arguments
          rw.set_module("fc", smaller_linear)                                # swap a module its callers call
          rw.erase(unused_node)                                              # drop a node nothing reads
          rw.bypass(dropout_node, dropout_node.args[0])                      # erase, users take the input
          rw.replace(node, "call_module", "attn", (q, k, v), module=m)       # same name, new computation
          rw.replace_pattern(nodes, build)                                   # a matched subgraph -> new nodes

  On exit the engine derives metadata for every new or touched node (in graph order, from the values
  recorded on their inputs, see passes/propagate.py), drops submodules nothing calls any more and
  lints the graph. Metadata after a rewrite equals what the metadata passes compute afresh.

Callers recompile (the pass decorator does it for transforms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph.metadata import has_meta
from .propagate import derive_nodes, has_values, incomplete_nodes, init_node
from .select import select_nodes

__all__ = ["Builder", "GraphRewrite", "Injection", "NoMatchError", "complete_metadata", "delete_unused_submodules",
           "describe_candidates",
           "inject_modules", "param_users", "refresh_nodes", "set_module", "swap_module"]

Builder = Callable[[str, nn.Module], nn.Module | None]
CallOp = Literal["call_module", "call_function", "call_method"]


class NoMatchError(ValueError):
    """A selector matched no layer; the message lists what could have matched."""


@dataclass(frozen=True)
class Injection:
    """One replaced layer: where, what it was, what it is now."""

    name: str
    old_type: str
    new_type: str


# -- metadata upkeep --------------------------------------------------------------------------------
def refresh_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None) -> None:
    """Make ``nodes``' metadata (default: all) what a fresh metadata pass would record.

    A graph without metadata is left alone; a graph with identities only gets identities; a graph
    with recorded values gets values derived from the nodes' inputs. Software/hardware records stay.
    """
    chosen = list(gm.graph.nodes) if nodes is None else [n for n in nodes if n.graph is gm.graph]
    if not chosen or not any(has_meta(n) for n in gm.graph.nodes):
        return
    if has_values(gm):
        derive_nodes(gm, chosen)
        return
    for node in chosen:
        software = node.meta["fxforge"].software if has_meta(node) else None
        init_node(node, gm)
        if software is not None:
            node.meta["fxforge"].software = software


def complete_metadata(gm: fx.GraphModule) -> None:
    """Re-derive the nodes whose values are missing, after a state change that lets them run (e.g.
    calibration fixing the scales an uncalibrated quantizer refused to run without)."""
    if has_values(gm):
        derive_nodes(gm, incomplete_nodes(gm))


def param_users(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes whose recorded values mention parameters (call_module, get_attr and its users): what a
    requires_grad change must refresh."""
    out: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") or any(i.op == "get_attr" for i in node.all_input_nodes):
            out.append(node)
    return out


# -- module swaps -----------------------------------------------------------------------------------
def describe_candidates(gm: fx.GraphModule, limit: int = 8) -> str:
    """A short list of the call_module layers a selector could name: 'Linear: a.b, c.d, ...'."""
    by_type: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            by_type.setdefault(type(gm.get_submodule(str(node.target))).__name__, []).append(str(node.target))
    parts = [f"{t} ({len(v)}): {', '.join(v[:3])}{', ...' if len(v) > 3 else ''}" for t, v in by_type.items()]
    return "; ".join(parts[:limit]) or "no call_module layers"


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``path`` under ``root`` (parents must exist). No metadata upkeep:
    use :func:`swap_module` on a graph."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def _callers(gm: fx.GraphModule, paths: set[str]) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) in paths]


def swap_module(gm: fx.GraphModule, path: str, module: nn.Module) -> Injection:
    """Replace the module at ``path`` and refresh the metadata of every node that calls it."""
    old = gm.get_submodule(path)
    set_module(gm, path, module)
    refresh_nodes(gm, _callers(gm, {path}))
    return Injection(path, type(old).__name__, type(module).__name__)


def inject_modules(gm: fx.GraphModule, targets: Any, exclude: Any, build: Builder,
                   what: str = "layer") -> list[Injection]:
    """Replace every selected call_module's module by ``build(name, module)`` (None = leave it).

    A module called from several nodes is replaced once; the calling nodes' metadata is refreshed.
    Raises NoMatchError when the selector matches nothing or every match was declined by ``build``.
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
    refresh_nodes(gm, _callers(gm, set(done)))
    return list(done.values())


def delete_unused_submodules(gm: fx.GraphModule) -> None:
    """torch.fx's clean-up of modules no node names (``delete_all_unused_submodules``), except that a module
    object still called inside a called module (e.g. a checkpointed region's alias of a layer) stays at every
    path where it lives, with its ancestors and its own submodules."""
    used: set[str] = set()
    called: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            parts = node.target.split(".")
            used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            if node.op == "call_module":
                try:
                    sub = gm.get_submodule(node.target)
                except AttributeError:
                    continue
                called.update(id(m) for m in sub.modules())
                used.update(f"{node.target}.{name}" for name, _ in sub.named_modules() if name)
    for path, module in gm.named_modules(remove_duplicate=False):
        if path and id(module) in called:
            parts = path.split(".")
            used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in [name for name, _ in gm.named_modules() if name and name not in used]:
        gm.delete_submodule(name)


# -- graph rewrites ---------------------------------------------------------------------------------
class GraphRewrite:
    """A batch of node-level edits whose metadata is derived when the ``with`` block ends.

    Edits: :meth:`call_module` / :meth:`call_function` / :meth:`get_attr` (insert), :meth:`set_arg` /
    :meth:`set_args` (rewire), :meth:`set_module` (swap the module behind call nodes), :meth:`erase` (a
    node nothing reads), :meth:`bypass` (erase a node, its users take a value), :meth:`replace` (a node
    computes something else under the same name), :meth:`replace_pattern` (a subgraph becomes new
    nodes). Touched nodes are re-derived (and their users, when their results change); :meth:`touch`
    adds nodes changed by other means (e.g. a module mutated in place). Passes edit the graph only
    through these methods, so the metadata upkeep cannot be skipped.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.touched: set[fx.Node] = set()
        self.erased = 0
        self.inserted = 0

    def __enter__(self) -> GraphRewrite:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finish()

    def touch(self, *nodes: fx.Node) -> None:
        """Mark nodes whose metadata must be re-derived."""
        self.touched.update(nodes)

    def _insert_point(self, before: fx.Node | None, after: fx.Node | None) -> Any:
        if (before is None) == (after is None):
            raise ValueError("give exactly one of before= or after=")
        return self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(after)

    def call_module(self, path: str, module: nn.Module | None, args: tuple[Any, ...],
                    kwargs: dict[str, Any] | None = None, *, before: fx.Node | None = None,
                    after: fx.Node | None = None) -> fx.Node:
        """Insert a call of the module at ``path`` (registered there first when ``module`` is given)."""
        if module is not None:
            self.gm.add_submodule(path, module)
        with self._insert_point(before, after):
            node = self.graph.call_module(path, args, kwargs)
        self.inserted += 1
        self.touch(node)
        return node

    def call_function(self, target: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any] | None = None, *, before: fx.Node | None = None,
                      after: fx.Node | None = None) -> fx.Node:
        """Insert a call_function node."""
        with self._insert_point(before, after):
            node = self.graph.call_function(target, args, kwargs)
        self.inserted += 1
        self.touch(node)
        return node

    def get_attr(self, path: str, *, before: fx.Node | None = None, after: fx.Node | None = None,
                 buffer: torch.Tensor | None = None) -> fx.Node:
        """Insert a read of the parameter / buffer at ``path`` (``buffer`` is first registered there on the
        root: a new constant, e.g. a folded value)."""
        if buffer is not None:
            self.gm.register_buffer(path, buffer)
        with self._insert_point(before, after):
            node = self.graph.get_attr(path)
        self.inserted += 1
        self.touch(node)
        return node

    def order(self) -> dict[fx.Node, int]:
        """Each node's position in the graph now (to compare where two nodes are)."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def erase(self, node: fx.Node) -> None:
        """Erase a node nothing reads (ValueError naming it otherwise: use :meth:`bypass`)."""
        if node.users:
            raise ValueError(f"cannot erase node {node.name!r}: {[u.name for u in node.users]} read it; use bypass")
        self.touched.discard(node)
        self.graph.erase_node(node)
        self.erased += 1

    def set_args(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        """Replace all of ``node``'s positional arguments (and its keyword ones when ``kwargs`` is given)."""
        node.args = tuple(args)
        if kwargs is not None:
            node.kwargs = dict(kwargs)
        self.touch(node)

    def set_module(self, path: str, module: nn.Module) -> None:
        """Put ``module`` at ``path``; the nodes that call it are re-derived (e.g. a resized layer)."""
        set_module(self.gm, path, module)
        self.touch(*_callers(self.gm, {path}))

    def set_arg(self, node: fx.Node, index: int, value: Any) -> None:
        """Replace positional argument ``index`` of ``node``."""
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
        self.touch(node)

    def redirect_users(self, node: fx.Node, value: fx.Node, keep: Callable[[fx.Node], bool] | None = None) -> None:
        """Users of ``node`` read ``value`` instead (except those ``keep`` names, e.g. ``value`` itself)."""
        users = [u for u in node.users if keep is None or not keep(u)]
        for user in users:
            user.replace_input_with(node, value)
        self.touch(*users)

    def bypass(self, node: fx.Node, value: Any) -> None:
        """Erase ``node``; its users read ``value`` (a node or constant) instead."""
        users = list(node.users)
        node.replace_all_uses_with(value) if isinstance(value, fx.Node) else [
            u.replace_input_with(node, value) for u in users]
        self.erase(node)
        self.touch(*users)

    def replace(self, node: fx.Node, op: CallOp, target: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None = None, *, module: nn.Module | None = None) -> fx.Node:
        """Make ``node`` compute ``op(target)(*args, **kwargs)`` in place: its name and users stay
        (reports and baselines match nodes by name). ``module`` is registered at ``target`` first."""
        if module is not None:
            self.gm.add_submodule(str(target), module)
        node.op, node.target = op, target
        node.args, node.kwargs = args, dict(kwargs or {})
        self.touch(node, *node.users)
        return node

    def replace_pattern(self, nodes: list[fx.Node], build: Callable[[GraphRewrite, fx.Node], fx.Node]) -> fx.Node:
        """Replace a matched subgraph (``nodes`` in graph order; the last is its single output) by the
        node ``build(self, last)`` returns (``build`` inserts new nodes before ``last``). Nodes of the
        pattern nobody else uses are erased."""
        last = nodes[-1]
        new = build(self, last)
        last.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        self.touch(new, *new.users)
        for node in reversed(nodes):
            if not node.users:
                self.erase(node)
        return new

    def finish(self) -> None:
        """Derive metadata of touched nodes, drop unused submodules, lint."""
        alive = set(self.graph.nodes)
        live = {n for n in self.touched if n in alive}
        self.graph.lint()
        delete_unused_submodules(self.gm)
        refresh_nodes(self.gm, live)
        self.touched.clear()
