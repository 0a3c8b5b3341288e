"""Checkpoint specs for torch.nn's activation, normalisation and shape modules, built from their signatures.

Each class's config is its constructor's parameters (``inspect.signature``, minus device/dtype), each read
back from the instance attribute of the same name; loading checks every value against the parameter's
annotation (strings only from the enumerated choices torch accepts) and that the rebuilt module writes the
same config back. Importing this module registers them all under ``torch.nn.<Name>``.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

import torch
import torch.nn as nn
from torch.nn.modules import (
    activation,
    batchnorm,
    channelshuffle,
    dropout,
    flatten,
    instancenorm,
    normalization,
    padding,
    pixelshuffle,
    pooling,
    upsampling,
)

from .targets import CheckpointError, ModuleSpec, register_module

__all__ = ["EXCLUDED", "FAMILIES", "REGISTERED", "constructor_keys"]

# torch.nn's own module lists whose every class is registered here or excluded below with a reason.
FAMILIES = (activation, normalization, batchnorm, instancenorm, pooling, padding, flatten, upsampling,
            pixelshuffle, channelshuffle, dropout)
# Layers outside those lists that captured vision/audio models keep as call_module nodes.
_EXTRA: tuple[type[nn.Module], ...] = (nn.Identity, nn.Bilinear, nn.Conv3d, nn.ConvTranspose1d,
                                       nn.ConvTranspose2d, nn.ConvTranspose3d)
_LAZY = ("a lazy module has uninitialised parameters until its first call, which turns it into its "
         "non-lazy class (registered); a checkpoint only ever holds that class")
EXCLUDED: dict[type[nn.Module], str] = {
    **{getattr(f, n): _LAZY for f in FAMILIES for n in f.__all__ if n.startswith("Lazy")},
    nn.SyncBatchNorm: "its process_group is a live torch.distributed object, not a JSON value; convert it to "
                      "BatchNorm*d for export (in eval mode both compute the same)",
    nn.FractionalMaxPool2d: "it draws fresh random pooling regions on every call, also in eval mode, so no "
                            "checkpoint can reproduce its outputs",
    nn.FractionalMaxPool3d: "it draws fresh random pooling regions on every call, also in eval mode, so no "
                            "checkpoint can reproduce its outputs",
}
# Constructor parameters that are deprecated aliases of others (no attribute of their own).
_ALIASES: dict[type[nn.Module], frozenset[str]] = {nn.Hardtanh: frozenset({"min_value", "max_value"})}
# Types for parameters torch leaves unannotated (MultiheadAttention's constructor has no annotations).
_TYPES: dict[type[nn.Module], dict[str, Any]] = {
    nn.MultiheadAttention: {"embed_dim": int, "num_heads": int, "dropout": float, "bias": bool,
                            "add_bias_kv": bool, "add_zero_attn": bool, "kdim": int | None, "vdim": int | None,
                            "batch_first": bool},
}
# The strings torch accepts where a parameter admits ``str`` (torch checks them in the constructor or the
# functional call, with no public constant): GELU's approximation, interpolation modes, conv padding names.
_CHOICES: dict[str, tuple[str, ...]] = {
    "approximate": ("none", "tanh"),
    "mode": ("nearest", "linear", "bilinear", "bicubic", "trilinear", "area", "nearest-exact"),
    "padding": ("same", "valid"),
}
_SKIP = frozenset({"self", "device", "dtype"})


def _bias(m: nn.Module) -> bool:
    """A layer's ``bias`` flag; without an affine transform torch ignores it, so its default (True) is canonical."""
    if not getattr(m, "affine", getattr(m, "elementwise_affine", True)):
        return True
    return getattr(m, "in_proj_bias" if isinstance(m, nn.MultiheadAttention) else "bias", None) is not None


# Constructor parameters whose instance attribute is not the value given (computed instead).
_READBACK: dict[str, Callable[[nn.Module], Any]] = {"bias": _bias}
_CLASS_READBACK: dict[type[nn.Module], dict[str, Callable[[Any], Any]]] = {
    nn.MultiheadAttention: {"add_bias_kv": lambda m: m.bias_k is not None},
}


def constructor_keys(cls: type[nn.Module]) -> dict[str, inspect.Parameter]:
    """The constructor parameters a config of ``cls`` holds (name → parameter, with its type resolved)."""
    sig = inspect.signature(cls.__init__, eval_str=True)
    out: dict[str, inspect.Parameter] = {}
    for p in sig.parameters.values():
        if p.name in _SKIP or p.name in _ALIASES.get(cls, ()) or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        typ = _TYPES.get(cls, {}).get(p.name, p.annotation)
        if typ is inspect.Parameter.empty:
            raise TypeError(f"{cls.__name__}.{p.name} has no annotation: give its type in _TYPES")
        if p.default is None:  # some annotations omit the None their default is (AvgPool1d's stride)
            typ = typ | None
        out[p.name] = p.replace(annotation=typ)
    return out


def _matches(value: Any, typ: Any, key: str) -> bool:
    """True when a JSON value is of type ``typ`` (a constructor annotation; lists stand for tuples)."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is None or typ is type(None):
        return value is None
    if typ is bool:
        return type(value) is bool
    if typ is int:
        return type(value) is int
    if typ is float:
        return (type(value) is int and abs(value) <= 2**53) or (type(value) is float and math.isfinite(value))
    if typ is str:
        return isinstance(value, str) and value in _CHOICES.get(key, ())
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in (Union, types.UnionType):
        return any(_matches(value, a, key) for a in args)
    if typ is torch.Size:
        return _matches(value, list[int], key)
    if origin in (tuple, list):
        if not isinstance(value, list):
            return False
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return all(_matches(v, args[0], key) for v in value)
        return len(value) == len(args) and all(_matches(v, a, key) for v, a in zip(value, args, strict=True))
    raise TypeError(f"constructor parameter {key!r} has an annotation checkpoints cannot hold: {typ!r}")


def _short(value: Any, limit: int = 120) -> str:
    """A checkpoint value for an error message, cut short (it may be long and is hostile)."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _spec_functions(cls: type[nn.Module]) -> tuple[Callable[[nn.Module], dict[str, Any]],
                                                   Callable[[dict[str, Any]], nn.Module], frozenset[str]]:
    """to_config / from_config / keys of ``cls``, derived from its constructor signature."""
    params = constructor_keys(cls)
    name = f"torch.nn.{cls.__name__}"
    readback = {**{k: f for k, f in _READBACK.items() if k in params}, **_CLASS_READBACK.get(cls, {})}
    for key, p in params.items():  # a class whose defaults JSON cannot hold fails here, at import
        if p.default is not inspect.Parameter.empty and not _matches(_jsonable(p.default), p.annotation, key):
            raise TypeError(f"{cls.__name__}.{key}: default {p.default!r} is not a {p.annotation}")

    def check(config: Any, what: str) -> None:
        if not isinstance(config, dict):
            raise CheckpointError(f"{name}: {what} must be a JSON object")
        unknown = sorted(set(config) - set(params), key=str)
        if unknown:
            raise CheckpointError(f"{name}: {what} has unknown keys {unknown}; allowed: {sorted(params)}")
        for key, value in config.items():
            if not _matches(value, params[key].annotation, key):
                raise CheckpointError(f"{name}: {what}[{key!r}] = {_short(value)} is not a {params[key].annotation}"
                                      + (f" (allowed: {list(_CHOICES[key])})" if key in _CHOICES else ""))

    def to_config(m: nn.Module) -> dict[str, Any]:
        config = {k: _jsonable(readback[k](m) if k in readback else getattr(m, k)) for k in params}
        check(config, f"the config of {m!r}")
        return config

    def from_config(config: dict[str, Any]) -> nn.Module:
        check(config, "config")
        missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in config]
        if missing:
            raise CheckpointError(f"{name}: config lacks the required keys {missing}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
        try:
            module = cls(**kwargs)
        except Exception as exc:  # torch's own argument checks (ranges, divisibility) refuse it
            raise CheckpointError(f"{name}: its constructor refuses config {_short(config)}: {_short(exc)}") from None
        written = to_config(module)
        changed = sorted(k for k, v in config.items() if written[k] != v)
        if changed:
            raise CheckpointError(f"{name}: config keys {changed} do not read back as given (a config fxforge "
                                  f"writes always does): {_short({k: config[k] for k in changed})}")
        return module

    return to_config, from_config, frozenset(params)


def _classes() -> list[type[nn.Module]]:
    """Every class this module registers: torch.nn's family lists minus the exclusions, plus the extras."""
    listed = [getattr(f, n) for f in FAMILIES for n in f.__all__]
    return [c for c in (*listed, *_EXTRA) if c not in EXCLUDED]


def _register_all() -> dict[type[nn.Module], ModuleSpec[Any]]:
    specs: dict[type[nn.Module], ModuleSpec[Any]] = {}
    for cls in _classes():
        to_config, from_config, keys = _spec_functions(cls)
        specs[cls] = register_module(cls, to_config, from_config, name=f"torch.nn.{cls.__name__}", keys=keys)
    return specs


REGISTERED: dict[type[nn.Module], ModuleSpec[Any]] = _register_all()
