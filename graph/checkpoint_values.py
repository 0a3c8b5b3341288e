"""JSON encoding of the values a checkpoint's graph holds (node arguments): everything JSON has no type
for (nodes, tensors, dtypes, devices, slices, tuples, non-finite floats) becomes a tagged dict."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .limits import MAX_CLASS_NAME_CHARS, MAX_MODULE_STACK, MAX_STACK_PATH_CHARS
from .targets import CheckpointError, is_identifier

IDENT = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
_NAMED = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}
Env = dict[tuple[str, str], Any]


_PART = re.compile(r"\A[A-Za-z0-9_]+\Z")  # one component of a module/attribute path (digits for Sequential)
_RESERVED_NODE_NAMES = frozenset({"self"})  # names the generated forward() already binds


def check_path(path: Any, where: str) -> list[str]:
    """The components of a dotted module/attribute path; each must be a plain name (no code, no dunders)."""
    parts = path.split(".") if isinstance(path, str) else [""]
    if not all(_PART.fullmatch(p) and not p.startswith("__") and (is_identifier(p) or p.isdigit()) for p in parts):
        raise CheckpointError(f"{where}: bad module/attribute path {path!r}"[:300])
    return parts


def check_node_name(name: Any, where: str) -> str:
    """``name`` itself; refused when it is not an identifier, is a keyword, or is bound by the generated forward()."""
    if not isinstance(name, str) or not is_identifier(name) or name in _RESERVED_NODE_NAMES:
        raise CheckpointError(f"{where}: malformed node (names and keywords must be identifiers, not "
                              f"{sorted(_RESERVED_NODE_NAMES)})")
    return name


def check_module_stack(stack: Any, where: str) -> list[tuple[str, str]]:
    """A node's module stack as a checkpoint stores it (outermost first): at most ``MAX_MODULE_STACK``
    [module path, class name] pairs, each path "" (the model) or one :func:`check_path` accepts of at most
    ``MAX_STACK_PATH_CHARS`` characters, each class name "" (unknown) or an ASCII identifier of at most
    ``MAX_CLASS_NAME_CHARS`` characters."""
    what = f"{where}: module stack"
    if not isinstance(stack, list) or len(stack) > MAX_MODULE_STACK:
        raise CheckpointError(f"{what} must be a list of at most {MAX_MODULE_STACK} [path, class name] pairs")
    out = []
    for entry in stack:
        if not isinstance(entry, list) or len(entry) != 2:
            raise CheckpointError(f"{what} must hold [path, class name] pairs")
        path, cls = entry
        if isinstance(path, str) and len(path) > MAX_STACK_PATH_CHARS:
            raise CheckpointError(f"{what}: a module path of {len(path)} characters (at most "
                                  f"{MAX_STACK_PATH_CHARS} allowed)")
        if path != "":  # "": the model itself (torch.export's outermost entry)
            check_path(path, what)
        if not isinstance(cls, str) or len(cls) > MAX_CLASS_NAME_CHARS or not (cls == "" or IDENT.match(cls)):
            raise CheckpointError(f"{what}: a class name must be an identifier of at most {MAX_CLASS_NAME_CHARS} "
                                  "characters")
        out.append((path, cls))
    return out


def join(prefix: str, name: str) -> str:
    """``prefix.name`` (or ``name`` at the root)."""
    return f"{prefix}.{name}" if prefix else name


def encode_value(v: Any, where: str, tensor: Callable[[torch.Tensor], str] | None = None) -> Any:
    """JSON form of a value; tagged dicts (``{"$": kind}``) for everything JSON has no type for."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"$": "float", "value": repr(v)}
    if isinstance(v, fx.Node):
        return {"$": "node", "name": v.name}
    if isinstance(v, torch.Tensor) and tensor is not None:
        return {"$": "tensor", "key": tensor(v)}
    if t in _NAMED.values():
        return {"$": next(k for k, c in _NAMED.items() if c is t), "name": str(v).removeprefix("torch.")}
    if t is torch.device:
        return {"$": "device", "value": str(v)}
    if t is complex:
        return {"$": "complex", "items": [encode_value(v.real, where), encode_value(v.imag, where)]}
    if v is Ellipsis:
        return {"$": "ellipsis"}
    if t in (slice, tuple, torch.Size):
        items = (v.start, v.stop, v.step) if t is slice else v
        return {"$": {slice: "slice", tuple: "tuple", torch.Size: "size"}[t],
                "items": [encode_value(x, where, tensor) for x in items]}
    if isinstance(v, list):
        return [encode_value(x, where, tensor) for x in v]
    if isinstance(v, dict) and not hasattr(v, "default_factory"):
        pairs = [[encode_value(k, where, tensor), encode_value(x, where, tensor)] for k, x in v.items()]
        return {"$": "dict", "items": pairs}
    raise CheckpointError(f"{where}: cannot store a value of type {t.__module__}.{t.__qualname__} in a checkpoint")


def decode_value(d: Any, where: str, env: Env) -> Any:
    """Inverse of :func:`encode_value`; node and tensor references must already be in ``env``."""
    if d is None or type(d) in (bool, int, float, str):
        return d
    if isinstance(d, list):
        return [decode_value(x, where, env) for x in d]
    if not isinstance(d, dict) or not isinstance(d.get("items", []), list):
        raise CheckpointError(f"{where}: malformed value {d!r}")
    tag = d.get("$")
    if tag in ("node", "tensor"):
        key = d.get("name" if tag == "node" else "key")
        if not isinstance(key, str) or (tag, key) not in env:
            raise CheckpointError(f"{where}: reference to unknown {tag} {key!r} (must be defined earlier)")
        return env[(tag, key)]
    if tag in _NAMED:
        value = getattr(torch, d["name"], None) if IDENT.match(str(d.get("name"))) else None
        if not isinstance(value, _NAMED[tag]):
            raise CheckpointError(f"{where}: unknown {tag} {d.get('name')!r}")
        return value
    if tag == "device":
        return torch.device(str(d.get("value")))
    if tag == "float" and d.get("value") in ("inf", "-inf", "nan"):
        return float(d["value"])
    if tag == "ellipsis":
        return Ellipsis
    items = [decode_value(x, where, env) for x in d.get("items", [])]
    if tag in ("slice", "complex") and len(items) == (3 if tag == "slice" else 2):
        return slice(*items) if tag == "slice" else complex(*items)
    if tag in ("tuple", "size"):
        return tuple(items) if tag == "tuple" else torch.Size(items)
    if tag == "dict" and all(isinstance(kv, list) and len(kv) == 2 for kv in items):
        return {k: v for k, v in items}
    raise CheckpointError(f"{where}: malformed value {d!r}")
