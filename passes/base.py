"""The pass protocol: ``pass_fn(graph, pass_args=None) -> (graph, info)``.

A pass declares its arguments as a frozen dataclass; the dict a caller passes is validated against it
(an unknown key is an error listing the allowed ones, a wrong type names the key) and copied, so the
caller's dict is never mutated. Transforms are linted and recompiled after they run, every pass is
recorded in the graph's history, and any failure is re-raised as a :class:`PassError` naming the pass.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import torch
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph, PassRecord
from .contract import NumericalContract, PassInfo, PassSpec, check_declared, holds, jsonable, requirement_errors

PassKind = Literal["analysis", "transform"]
PASS_KINDS: tuple[str, ...] = ("analysis", "transform")


class PassError(RuntimeError):
    """A pass failed; the message names the pass and, when known, the node."""


class PassArgsError(ValueError):
    """pass_args do not fit the pass: unknown key, wrong type or invalid value."""


@dataclasses.dataclass(frozen=True)
class NoArgs:
    """Arguments of a pass that takes none."""


A = TypeVar("A")
PassFn = Callable[..., tuple[Any, Any]]

PASSES: dict[str, PassFn] = {}
PASS_ALIASES: dict[str, str] = {}  # old public name -> registered name (same pass, listed once in PASSES)


def _type_ok(value: Any, hint: Any) -> bool:
    if hint is Any or hint is object:
        return True
    origin = get_origin(hint)
    if origin is Literal:
        return value in get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in get_args(hint))
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        params = get_args(hint)
        if len(params) == 2 and params[1] is Ellipsis:
            return all(_type_ok(v, params[0]) for v in value)
        return len(params) == len(value) and all(_type_ok(v, h) for v, h in zip(value, params))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if origin is not None:
        return isinstance(value, origin) if isinstance(origin, type) else True
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _coerce(value: Any, hint: Any) -> Any:
    """Lists become tuples where a tuple is expected; ints become floats where a float is."""
    if isinstance(value, list) and (get_origin(hint) is tuple or any(
        get_origin(h) is tuple for h in get_args(hint)
    )):
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def build_args(pass_name: str, args_type: type[A], pass_args: Mapping[str, Any] | None) -> A:
    """Validate ``pass_args`` against the dataclass ``args_type`` and build a fresh instance.

    An args type with a ``from_pass_args(mapping)`` classmethod parses free-form configs itself (e.g.
    MASE's quantization config keyed by op names); its ValueError becomes a PassArgsError.
    """
    if pass_args is None:
        pass_args = {}
    if isinstance(pass_args, args_type):
        return pass_args
    parse = getattr(args_type, "from_pass_args", None)
    if parse is not None:
        try:
            return parse(pass_args)
        except (TypeError, ValueError) as exc:
            raise PassArgsError(f"{pass_name}: {exc}") from None
    if not isinstance(pass_args, Mapping):
        raise PassArgsError(f"{pass_name}: pass_args must be a dict or None, got {type(pass_args).__name__}")
    fields = {f.name: f for f in dataclasses.fields(args_type)}  # type: ignore[arg-type]
    unknown = sorted(set(pass_args) - set(fields))
    if unknown:
        raise PassArgsError(f"{pass_name}: unknown pass_args key(s) {unknown}; allowed keys: {sorted(fields)}")
    hints = typing.get_type_hints(args_type)
    kwargs: dict[str, Any] = {}
    for key, value in pass_args.items():
        value = _coerce(value, hints[key])
        if not _type_ok(value, hints[key]):
            raise PassArgsError(
                f"{pass_name}: pass_args[{key!r}] = {value!r} does not match the expected type {hints[key]}"
            )
        kwargs[key] = value if isinstance(value, torch.Tensor | nn.Module) else copy.deepcopy(value)
    try:
        return args_type(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PassArgsError(f"{pass_name}: {exc}") from exc


def args_record(args: Any) -> dict[str, Any]:
    """JSON view of a pass's args for the graph's history (tensors summarised by shape and dtype)."""
    return {f.name: jsonable(getattr(args, f.name)) for f in dataclasses.fields(args)}


def forge_pass(
    kind: PassKind,
    args_type: type[Any] = NoArgs,
    *,
    info: type[PassInfo] | None = None,
    requires: Iterable[str] = (),
    forbids: Iterable[str] = (),
    ensures: Iterable[str] = (),
    invalidates: Iterable[str] = (),
    contract: NumericalContract | None = None,
    accepts_module: bool = False,
    aliases: Iterable[str] = (),
):
    """Decorator turning ``fn(graph, args: args_type) -> (graph, info)`` into a registered pass.

    ``info`` is the pass's frozen :class:`PassInfo` subclass (checked on every call). ``requires`` /
    ``forbids`` name graph properties (passes/contract.py) checked before the pass runs, ``ensures``
    those it makes true (checked after), ``invalidates`` those it may make false; pipelines check a
    whole order against these before running. ``contract`` is a transform's numerical promise.
    ``accepts_module`` lets an analysis pass also take a bare nn.Module (MASE calls some on ``mg.model``).
    ``aliases``: former public names that :func:`get_pass` still resolves to this pass.
    """
    if kind not in PASS_KINDS:
        raise ValueError(f"pass kind must be one of {PASS_KINDS}, got {kind!r}")
    if not (isinstance(info, type) and issubclass(info, PassInfo)):
        raise ValueError(f"info= must be the pass's frozen PassInfo subclass (passes/contract.py), got {info!r}")
    if contract is not None and kind != "transform":
        raise ValueError("only transform passes declare a numerical contract")

    def wrap(fn: Callable[[Any, Any], tuple[Any, Any]]) -> PassFn:
        name = fn.__name__
        names = (name, *aliases)
        taken = [n for n in names if n in PASSES or n in PASS_ALIASES]
        if taken:
            raise ValueError(f"a pass named {taken[0]!r} is already registered")
        spec = PassSpec(
            name=name, kind=kind, args_type=args_type, info_type=info,
            requires=check_declared(requires, name), forbids=check_declared(forbids, name),
            ensures=check_declared(ensures, name), invalidates=check_declared(invalidates, name),
            contract=contract,
        )

        @functools.wraps(fn)
        def run(graph: Any, pass_args: Any = None) -> tuple[Any, Any]:
            args = build_args(name, args_type, pass_args)  # bad arguments are reported first
            is_graph = isinstance(graph, ForgeGraph)
            if not is_graph and not (accepts_module and isinstance(graph, nn.Module)):
                raise TypeError(f"{name}: expected a ForgeGraph, got {type(graph).__name__}")
            if is_graph:
                errors = requirement_errors(spec, lambda p: holds(p, graph), PASSES)
                if errors:
                    raise PassError(f"{name}: " + "; ".join(errors))
            try:
                out, result = fn(graph, args)
                if kind == "transform":
                    out.recompile()
            except (PassError, PassArgsError):
                raise
            except Exception as exc:
                raise PassError(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            if not isinstance(result, info):
                raise PassError(f"{name} returned info of type {type(result).__name__}, declared {info.__name__}")
            if is_graph:
                broken = [p for p in spec.ensures if not holds(p, out)]
                if broken:
                    raise PassError(f"{name} promised {broken} but they do not hold after it ran")
                out.history.append(PassRecord(name=name, kind=kind, args=args_record(args)))
            return out, result

        run.pass_name = name  # type: ignore[attr-defined]
        run.pass_kind = kind  # type: ignore[attr-defined]
        run.args_type = args_type  # type: ignore[attr-defined]
        run.spec = spec  # type: ignore[attr-defined]
        PASSES[name] = run
        PASS_ALIASES.update(dict.fromkeys(aliases, name))
        return run

    return wrap


def get_pass(name: str) -> PassFn:
    """A registered pass by name (or former name); KeyError listing the registered ones."""
    name = PASS_ALIASES.get(name, name)
    if name not in PASSES:
        raise KeyError(f"no pass named {name!r}; registered: {sorted(PASSES)}")
    return PASSES[name]


def unregister_pass(name: str) -> None:
    """Remove a pass and its aliases from the registry (tests registering scratch passes clean up with it)."""
    PASSES.pop(name, None)
    for alias in [a for a, target in PASS_ALIASES.items() if target == name]:
        del PASS_ALIASES[alias]
