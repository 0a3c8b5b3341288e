"""One selector language for every pass (LoRA targets, quantization, pruning, freezing).

A selector picks graph nodes by **type** (canonical op such as ``"linear"``, a class name such as
``"Linear"``, or an nn.Module class), by **name** (a module path such as ``"classifier"``; a name also
matches as a dotted suffix, so ``"query"`` selects every ``...attention.self.query``), by **regex**
(``re.fullmatch`` on the node's name) or by **predicate** ``fn(name, module_or_None, op) -> bool``.

Spec forms: ``{"type": [...], "name": [...], "regex": [...], "predicate": fn}`` (a node matching any
entry is selected), an nn.Module class, a callable predicate, or a list mixing those. A node's name is
its module path for call_module nodes and its fx node name otherwise.

**One meaning of "empty", in every pass.** A selector matches a node when any of its entries does, so
an empty selector matches nothing. An omitted ``targets`` (None) means the pass's default set, which
each pass documents (LoRA: every nn.Linear; fuse_kernels: every pattern match; prune: every Linear /
Conv...); an explicitly empty ``targets`` (``{}``, ``[]``, ``{"name": []}``) would select nothing and
is refused when the pass's args are built. An omitted or empty ``exclude`` excludes nothing.

Passes parse their selector fields once, when their args dataclass is built
(:func:`parse_selector_fields` in ``__post_init__``): the args then hold :class:`Selector` objects and
nothing re-parses a spec per node.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch.fx as fx
import torch.nn as nn

from ..graph.ir import classify, known_op_or_class, module_op_name, resolve_op_name
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


@dataclass(frozen=True, repr=False)
class Selector:
    """A parsed, immutable selector (see module docstring); ``regexes`` keep their source text (the
    graph's history records it), compiled once here."""

    types: tuple[str | type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    regexes: tuple[str, ...] = ()
    predicates: tuple[Predicate, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(r) for r in self.regexes))

    def __repr__(self) -> str:
        parts = {"type": [t if isinstance(t, str) else t.__name__ for t in self.types], "name": list(self.names),
                 "regex": list(self.regexes), "predicate": [getattr(p, "__name__", "fn") for p in self.predicates]}
        return f"Selector({ {k: v for k, v in parts.items() if v} })"

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
            for t in types:
                if isinstance(t, str) and not known_op_or_class(t):
                    try:
                        resolve_op_name(t)
                    except ValueError as exc:
                        raise SelectorError(f"selector type: {exc}") from None
            names = _as_tuple(spec.get("name"))
            if not all(isinstance(n, str) for n in names):
                raise SelectorError(f"selector 'name' entries must be strings: {names}")
            regexes = []
            for pattern in _as_tuple(spec.get("regex")):
                try:
                    regexes.append(re.compile(pattern).pattern)
                except (re.error, TypeError) as exc:
                    raise SelectorError(f"selector regex {pattern!r} is invalid: {exc}") from exc
            preds = _as_tuple(spec.get("predicate"))
            if not all(callable(p) and not isinstance(p, type) for p in preds):
                raise SelectorError("selector 'predicate' must be callable(name, module, op) -> bool")
            return cls(types=types, names=names, regexes=tuple(regexes), predicates=preds)
        if isinstance(spec, type) and issubclass(spec, nn.Module):
            return cls(types=(spec,))
        if isinstance(spec, type):
            raise SelectorError(f"selector class {spec.__module__}.{spec.__qualname__} is not an nn.Module class; "
                                f"use an nn.Module class, a dict with keys {list(SELECTOR_KEYS)} or a predicate")
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
        if any(r.fullmatch(name) for r in self._compiled):  # type: ignore[attr-defined]  # set in __post_init__
            return True
        return any(p(name, module, op) for p in self.predicates)


def _every(name: str, module: nn.Module | None, op: str) -> bool:
    return True


EVERY: Selector = Selector(predicates=(_every,))  # a pass's default "no narrowing" (e.g. fuse_kernels' anchors)


def parse_selector_fields(args: Any, select: tuple[str, ...] = ("targets",),
                          exclude: tuple[str, ...] = ("exclude",)) -> None:
    """Parse a frozen args dataclass's selector fields once (call it from ``__post_init__``).

    ``select`` fields: None stays None (the pass's default set); any other spec becomes a Selector, and
    an empty one is refused (it would select nothing). ``exclude`` fields always become a Selector
    (None: excludes nothing). A bad spec is a ValueError naming the field (PassArgsError via build_args).
    """
    for key in (*select, *exclude):
        spec = getattr(args, key)
        if spec is None and key in select:
            continue
        try:
            parsed = Selector.parse(spec)
        except SelectorError as exc:
            raise SelectorError(f"'{key}': {exc}") from None
        if key in select and parsed.empty:
            raise SelectorError(f"'{key}' = {spec!r} is empty: an empty selector selects nothing, in every pass; "
                                f"omit '{key}' for the pass's default, or name what to select, e.g. "
                                "{'type': 'linear'} or {'name': ['query', 'value']}")
        object.__setattr__(args, key, parsed)


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
    return _by_selector(by, key).matches(name, module, op)


@functools.lru_cache(maxsize=1024)
def _by_selector(by: str, key: str) -> Selector:
    """A config key's Selector, parsed once per (by, key), not once per node."""
    return Selector.parse({by: [key]})


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
