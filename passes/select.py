"""One selector language for every pass (LoRA targets, quantization, pruning, freezing).

A selector picks graph nodes by **type** (canonical op such as ``"linear"``, a class name such as
``"Linear"``, or an nn.Module class), by **name** (a module path such as ``"classifier"``; a name also
matches as a dotted suffix, so ``"query"`` selects every ``...attention.self.query``), by **regex**
(``re.fullmatch`` on the node's name) or by **predicate** ``fn(name, module_or_None, op) -> bool``.

Spec forms: ``{"type": [...], "name": [...], "regex": [...], "predicate": fn}`` (a node matching any
entry is selected), an nn.Module class, a callable predicate, or a list mixing those. A node's name is
its module path for call_module nodes and its fx node name otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch.fx as fx
import torch.nn as nn

from ..graph.ir import classify, module_op_name
from ..graph.metadata import MetaRecord, get_meta, has_meta

Predicate = Callable[[str, nn.Module | None, str], bool]
SELECTOR_KEYS: tuple[str, ...] = ("type", "name", "regex", "predicate")


class SelectorError(ValueError):
    """A selector spec is malformed (unknown key, bad regex, wrong value type)."""


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, str | type) or callable(value):
        return (value,)
    return tuple(value)


@dataclass(frozen=True)
class Selector:
    """A parsed, immutable selector (see module docstring)."""

    types: tuple[str | type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    regexes: tuple[re.Pattern[str], ...] = ()
    predicates: tuple[Predicate, ...] = ()

    @classmethod
    def parse(cls, spec: Any) -> Selector:
        """Build a Selector from any accepted spec form; errors name the allowed keys."""
        if isinstance(spec, Selector):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - set(SELECTOR_KEYS))
            if unknown:
                raise SelectorError(f"unknown selector key(s) {unknown}; allowed: {list(SELECTOR_KEYS)}")
            types = _as_tuple(spec.get("type"))
            bad = [t for t in types if not (isinstance(t, str) or (isinstance(t, type) and issubclass(t, nn.Module)))]
            if bad:
                raise SelectorError(f"selector 'type' entries must be op/class names or nn.Module classes: {bad}")
            names = _as_tuple(spec.get("name"))
            if not all(isinstance(n, str) for n in names):
                raise SelectorError(f"selector 'name' entries must be strings: {names}")
            regexes = []
            for pattern in _as_tuple(spec.get("regex")):
                try:
                    regexes.append(re.compile(pattern))
                except (re.error, TypeError) as exc:
                    raise SelectorError(f"selector regex {pattern!r} is invalid: {exc}") from exc
            preds = _as_tuple(spec.get("predicate"))
            if not all(callable(p) for p in preds):
                raise SelectorError("selector 'predicate' must be callable(name, module, op) -> bool")
            return cls(types=types, names=names, regexes=tuple(regexes), predicates=preds)
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            return cls(types=(spec,))
        if callable(spec):
            return cls(predicates=(spec,))
        if isinstance(spec, Sequence) and not isinstance(spec, str):
            parts = [cls.parse(s) for s in spec]
            return cls(
                types=tuple(t for p in parts for t in p.types),
                names=tuple(n for p in parts for n in p.names),
                regexes=tuple(r for p in parts for r in p.regexes),
                predicates=tuple(f for p in parts for f in p.predicates),
            )
        raise SelectorError(
            f"cannot read selector {spec!r}: use a dict with keys {list(SELECTOR_KEYS)}, an nn.Module class, "
            "a predicate or a list of those"
        )

    @property
    def empty(self) -> bool:
        return not (self.types or self.names or self.regexes or self.predicates)

    def matches(self, name: str, module: nn.Module | None, op: str) -> bool:
        """True when any entry of the selector matches this (name, module, canonical op)."""
        for t in self.types:
            if isinstance(t, str):
                if t == op or (module is not None and type(module).__name__ == t):
                    return True
            elif module is not None and isinstance(module, t):
                return True
        for n in self.names:
            if name == n or name.endswith("." + n):
                return True
        if any(r.fullmatch(name) for r in self.regexes):
            return True
        return any(p(name, module, op) for p in self.predicates)


def node_identity(node: fx.Node, root: nn.Module) -> tuple[str, nn.Module | None, str]:
    """(name, module or None, canonical op) of a node, as selectors see it."""
    _, op = classify(node, root)
    if node.op == "call_module":
        return str(node.target), root.get_submodule(str(node.target)), op
    return node.name, None, op


def select_nodes(gm: fx.GraphModule, targets: Any, exclude: Any = None,
                 modules_only: bool = False) -> Iterator[tuple[fx.Node, str, nn.Module | None, str]]:
    """Yield (node, name, module, op) for call nodes matching ``targets`` and not ``exclude``."""
    include, skip = Selector.parse(targets), Selector.parse(exclude)
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        if modules_only and node.op != "call_module":
            continue
        name, module, op = node_identity(node, gm)
        if include.matches(name, module, op) and not skip.matches(name, module, op):
            yield node, name, module, op


def matches_by(by: str, key: str, name: str, module: nn.Module | None, op: str) -> bool:
    """MASE's ``by: type | name | regex`` config lookup, expressed in the same selector language."""
    if by not in ("type", "name", "regex"):
        raise SelectorError(f"'by' must be one of ['type', 'name', 'regex'], got {by!r}")
    return Selector.parse({by: [key]}).matches(name, module, op)


def select_modules(root: nn.Module, targets: Any, exclude: Any = None) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(path, module)`` for every named module of ``root`` (the module tree, not only graph
    nodes) matching ``targets`` and not ``exclude``; ``select_modules(root, Quantize)`` walks by type."""
    include, skip = Selector.parse(targets), Selector.parse(exclude)
    for path, module in root.named_modules():
        if not path:
            continue
        op = module_op_name(module)
        if include.matches(path, module, op) and not skip.matches(path, module, op):
            yield path, module


R = TypeVar("R", bound=MetaRecord)


class Layer(NamedTuple):
    """One call node found by :func:`iter_layers`: the node, its name (module path for call_module),
    its module (None for function nodes) and the requested software record (None when not asked)."""

    node: fx.Node
    path: str
    module: nn.Module | None
    record: Any


def iter_layers(gm: fx.GraphModule, types: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
                record: type[MetaRecord] | None = None) -> Iterator[Layer]:
    """The one walk over "layers of kind X": call nodes whose module is an instance of ``types``
    and/or whose software metadata holds a ``record`` (both given: both must hold)."""
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if types is not None and not isinstance(module, types):
            continue
        rec = None
        if record is not None:
            rec = get_meta(node).software.get(record) if has_meta(node) else None
            if rec is None:
                continue
        yield Layer(node, str(node.target) if module is not None else node.name, module, rec)
