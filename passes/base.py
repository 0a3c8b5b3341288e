"""The pass protocol: ``pass_fn(graph, pass_args=None) -> (graph, info)``.

A pass declares its arguments as a frozen dataclass; the dict a caller passes is validated against it
(an unknown key is an error listing the allowed ones, a wrong type names the key) and copied, so the
caller's dict is never mutated. Transforms are linted and recompiled after they run, every pass is
recorded in the graph's history, and any failure is re-raised as a :class:`PassError` naming the pass.

The one rule of graphs: **a transform never changes its input graph.** ``transform(mg, args)`` runs on
``mg.copy()`` and returns the new graph; ``mg`` (its modules, weights, metadata and history) is as it was,
so one base graph can be transformed again and again (MASE's per-trial loops). Analysis passes write
metadata on the graph given and return that same graph. Code that owns its graph (pipelines, search
trials, the compiler pipeline) calls ``transform.apply_inplace(mg, args)``, which changes and returns
``mg`` itself and saves the copy.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol, TypeVar, get_args, get_origin

import torch
import torch.nn as nn
import torch.utils.data

from ..graph.forge_graph import ForgeGraph, PassRecord
from .contract import (
    NumericalContract,
    PassInfo,
    PassSpec,
    check_declared,
    current_properties,
    holds,
    jsonable,
    requirement_errors,
)

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


class PassRun(Protocol):
    """The call shape of every pass: ``run(graph, pass_args=None) -> (graph, info)``."""

    def __call__(self, graph: Any, pass_args: Any = None) -> tuple[Any, Any]: ...


class PassFn(PassRun, Protocol):
    """A registered pass: ``pass_fn(graph, pass_args=None) -> (graph, info)`` plus its declarations.

    ``apply_inplace(graph, pass_args=None)`` runs a transform on ``graph`` itself (no copy) for callers that
    own the graph; for an analysis pass it is the same as calling the pass.
    """

    pass_name: str
    pass_kind: str
    args_type: type[Any]
    spec: PassSpec
    module_pass: bool
    apply_inplace: PassRun
    __name__: str
    __module__: str


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


_DATA_NAMES = frozenset({"data", "batches", "baseline", "dataset", "train_data", "eval_data", "example_inputs"})
_RANGES: dict[str, tuple[int, int]] = {"num_batches": (1, 2**31 - 1)}  # by field name, unless metadata says
_INT_LIMIT = 2**63  # no pass argument needs an integer beyond int64


def _is_data(field: dataclasses.Field[Any], value: Any) -> bool:
    """Data (batches, iterables, loaders, tensors, modules) is passed by reference, never deep-copied.

    A field is data when its metadata says so (``field(metadata={"data": True})``), when its name is one
    of the conventional data names, or when the value itself is a tensor, module, iterator or data loader.
    """
    if field.metadata.get("data") or field.name in _DATA_NAMES:
        return True
    if isinstance(value, torch.Tensor | nn.Module | Iterator | torch.utils.data.DataLoader | torch.utils.data.Dataset):
        return True
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | list | tuple | dict | set | frozenset)


def _check_range(pass_name: str, field: dataclasses.Field[Any], value: Any) -> None:
    """Integers within the field's declared range (metadata ``range=(lo, hi)`` or the name's convention)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return
    lo, hi = field.metadata.get("range", _RANGES.get(field.name, (-_INT_LIMIT, _INT_LIMIT - 1)))
    if not lo <= value <= hi:
        shown = value if abs(value) < 10**12 else f"{value:.3g}"
        raise PassArgsError(f"{pass_name}: pass_args[{field.name!r}] = {shown} is out of range: "
                            f"it must be in [{lo}, {hi}]")


def _mase_keys(pass_name: str, args_type: type, pass_args: Mapping[str, Any]) -> Mapping[str, Any]:
    """Rename MASE's pass keys (``MASE_ALIASES`` on the args class) and refuse ``MASE_REFUSED`` ones with the reason."""
    aliases: dict[str, str] = getattr(args_type, "MASE_ALIASES", {})
    refused: dict[str, str] = getattr(args_type, "MASE_REFUSED", {})
    for key in pass_args:
        if key in refused:
            raise PassArgsError(f"{pass_name}: MASE key {key!r} is not used by fxforge: {refused[key]}")
    if not any(k in aliases for k in pass_args):
        return pass_args
    out = dict(pass_args)
    for mase, ours in aliases.items():
        if mase in out:
            if ours in out:
                raise PassArgsError(f"{pass_name}: give {ours!r} or MASE's {mase!r}, not both")
            out[ours] = out.pop(mase)
    return out


def build_args(pass_name: str, args_type: type[A], pass_args: Mapping[str, Any] | None) -> A:
    """Validate ``pass_args`` against the dataclass ``args_type`` and build a fresh instance.

    Configuration values are deep-copied (the caller's dict is never shared or mutated); data values
    are passed by reference (see :func:`_is_data`). Every problem is a PassArgsError naming the key.
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
    declared = args_type if dataclasses.is_dataclass(args_type) else None
    if declared is None:
        raise TypeError(f"{pass_name}: its args type {args_type!r} is not a dataclass (declare one, see NoArgs)")
    fields = {f.name: f for f in dataclasses.fields(declared)}
    bad_keys = [k for k in pass_args if not isinstance(k, str)]
    if bad_keys:
        raise PassArgsError(f"{pass_name}: pass_args key {bad_keys[0]!r} ({type(bad_keys[0]).__name__}) is not a "
                            f"string; allowed keys: {sorted(fields)}")
    pass_args = _mase_keys(pass_name, args_type, pass_args)
    unknown = sorted(set(pass_args) - set(fields))
    if unknown:
        raise PassArgsError(f"{pass_name}: unknown pass_args key(s) {unknown}; allowed keys: {sorted(fields)}")
    hints = typing.get_type_hints(args_type)
    kwargs: dict[str, Any] = {}
    for key, value in pass_args.items():
        value = _coerce(value, hints[key])
        if not _type_ok(value, hints[key]):
            raise PassArgsError(
                f"{pass_name}: pass_args[{key!r}] = {value!r} does not match the expected type {hints[key]}"[:400]
            )
        _check_range(pass_name, fields[key], value)
        if _is_data(fields[key], value):
            kwargs[key] = value
            continue
        try:
            kwargs[key] = copy.deepcopy(value)
        except Exception as exc:
            raise PassArgsError(f"{pass_name}: pass_args[{key!r}] ({type(value).__name__}) cannot be copied as "
                                f"configuration ({type(exc).__name__}: {exc}); pass plain values, or data "
                                "(batches, iterables, loaders) in a data field") from None
    try:
        return args_type(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PassArgsError(f"{pass_name}: {exc}") from exc


def args_record(args: Any) -> dict[str, Any]:
    """JSON view of a pass's args for the graph's history (tensors summarised by shape and dtype)."""
    return {f.name: jsonable(getattr(args, f.name)) for f in dataclasses.fields(args)}


def graph_state(graph: ForgeGraph) -> tuple[Any, ...]:
    """What a transform can change, cheaply compared: the generated code, the graph properties that hold,
    every module's path, type and mode, every parameter and buffer's name, identity, shape, dtype,
    ``requires_grad`` and in-place version (``Tensor._version``). A value written through ``.data`` is
    invisible here: a pass that changes only such values sets ``changed`` itself."""
    gm = graph.model
    modules = tuple((path, type(m), m.training) for path, m in gm.named_modules())
    tensors = tuple((name, id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.requires_grad)
                    for name, t in (*gm.named_parameters(), *gm.named_buffers()))
    return gm.code, current_properties(graph), modules, tensors


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
    module_pass: bool = False,
    aliases: Iterable[str] = (),
):
    """Decorator turning ``fn(graph, args: args_type) -> (graph, info)`` into a registered pass.

    ``info`` is the pass's frozen :class:`PassInfo` subclass (checked on every call). ``requires`` /
    ``forbids`` name graph properties (passes/contract.py) checked before the pass runs, ``ensures``
    those it makes true (checked after), ``invalidates`` those it may make false; pipelines check a
    whole order against these before running. ``contract`` is a transform's numerical promise.
    ``accepts_module`` lets an analysis pass also take a bare nn.Module (MASE calls some on ``mg.model``).
    ``module_pass``: the pass takes a plain nn.Module only (MASE's module passes, for models that cannot be
    captured); a transform then runs on a deep copy of it, or on the module itself through ``apply_inplace``.
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

        def execute(graph: Any, pass_args: Any, inplace: bool) -> tuple[Any, Any]:
            args = build_args(name, args_type, pass_args)  # bad arguments are reported first
            is_graph = isinstance(graph, ForgeGraph)
            if module_pass and (is_graph or not isinstance(graph, nn.Module)):
                raise TypeError(f"{name}: expected a plain nn.Module (a module-level pass), got "
                                f"{type(graph).__name__}; for a ForgeGraph use the graph pass, or pass graph.model")
            if module_pass and kind == "transform" and not inplace:
                graph = copy.deepcopy(graph)  # the rule: a transform never changes its input
            if not is_graph and not ((accepts_module or module_pass) and isinstance(graph, nn.Module)):
                raise TypeError(f"{name}: expected a ForgeGraph, got {type(graph).__name__}")
            if is_graph:
                errors = requirement_errors(spec, lambda p: holds(p, graph), PASSES)
                if errors:
                    raise PassError(f"{name}: " + "; ".join(errors))
                if kind == "transform" and not inplace:
                    graph = graph.copy()  # the rule: a transform never changes its input graph
            before = graph_state(graph) if is_graph and kind == "transform" else None
            try:
                out, result = fn(graph, args)
                if kind == "transform" and is_graph:
                    out.recompile()
            except (PassError, PassArgsError):
                raise
            except Exception as exc:
                raise PassError(f"{name} failed: {type(exc).__name__}: {exc}") from exc
            if not isinstance(result, info):
                raise PassError(f"{name} returned info of type {type(result).__name__}, declared {info.__name__}")
            if before is not None and result.changed is None:
                changed = out is not graph or graph_state(out) != before
                object.__setattr__(result, "changed", changed)  # the info is frozen; it is the pass's fresh result
            if is_graph:
                broken = [p for p in spec.ensures if not holds(p, out)]
                if broken:
                    raise PassError(f"{name} promised {broken} but they do not hold after it ran")
                out.history.append(PassRecord(name=name, kind=kind, args=args_record(args)))
            return out, result

        @functools.wraps(fn)
        def run(graph: Any, pass_args: Any = None) -> tuple[Any, Any]:
            return execute(graph, pass_args, inplace=False)

        def apply_inplace(graph: Any, pass_args: Any = None) -> tuple[Any, Any]:
            """Run the pass on ``graph`` itself and return it: no copy, ``graph`` is changed (for callers that
            own the graph, e.g. pipelines and search trials). Calling the pass runs a transform on a copy."""
            return execute(graph, pass_args, inplace=True)

        apply_inplace.__name__ = apply_inplace.__qualname__ = f"{name}.apply_inplace"
        registered = typing.cast(PassFn, run)  # a plain function until its declarations are set just below
        registered.apply_inplace = apply_inplace
        registered.pass_name = name
        registered.pass_kind = kind
        registered.args_type = args_type
        registered.spec = spec
        registered.module_pass = module_pass
        PASSES[name] = registered
        PASS_ALIASES.update(dict.fromkeys(aliases, name))
        return registered

    return wrap


def get_pass(name: str) -> PassFn:
    """A registered pass by name, former name or MASE name (passes/mase_names.py); KeyError listing the
    registered ones, or naming the closest fxforge pass for a MASE name fxforge does not provide."""
    name = PASS_ALIASES.get(name, name)
    if name not in PASSES:
        from .mase_names import mase_pass_name  # the table reads PASSES: imported when first needed

        name = mase_pass_name(name) or name
    if name not in PASSES:
        raise KeyError(f"no pass named {name!r}; registered: {sorted(PASSES)}")
    return PASSES[name]


def unregister_pass(name: str) -> None:
    """Remove a pass and its aliases from the registry (tests registering scratch passes clean up with it)."""
    PASSES.pop(name, None)
    for alias in [a for a, target in PASS_ALIASES.items() if target == name]:
        del PASS_ALIASES[alias]
