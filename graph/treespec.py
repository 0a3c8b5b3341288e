"""fxforge's own schema for a graph's input/output pytree structure, and the TreeSpecs rebuilt from it.

torch's ``treespec_loads`` imports modules named in its JSON and fx pastes dict keys into generated
source, so checkpoints never carry torch's format. A structure here is ``"*"`` (a leaf),
``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": [[key, child], ...]}`` or
``{"output": "<registered class name>", "fields": [[key, child], ...]}``; keys are identifiers and
output classes resolve only against classes already registered (see ``targets.resolve_output_class``).

Copies of a graph share its TreeSpecs (:func:`spec_memo`, :func:`copy_codegen`): they are immutable, and
deep-copying one builds new ``LeafSpec`` objects, which torch deprecates (a FutureWarning per copy).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from . import targets
from .targets import CheckpointError, is_identifier

__all__ = ["copy_codegen", "decode_spec", "encode_spec", "spec_memo", "translate_v1_spec"]

_LEAF = pytree.treespec_leaf()


def _codegen_specs(codegen: Any) -> list[pytree.TreeSpec]:
    info = getattr(codegen, "pytree_info", None)
    return [s for s in info if isinstance(s, pytree.TreeSpec)] if isinstance(info, tuple) else []


def spec_memo(gm: fx.GraphModule) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo mapping each TreeSpec ``gm`` holds (its codegen's in/out specs, an exported
    module's ``_in_spec`` / ``_out_spec``) to itself, so a deep copy shares these immutable values."""
    specs = [v for v in vars(gm).values() if isinstance(v, pytree.TreeSpec)] + _codegen_specs(gm.graph._codegen)
    return {id(s): s for s in specs}


def copy_codegen(codegen: Any, memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of a graph's codegen (its mutable argument names included) sharing its TreeSpecs."""
    memo = dict(memo or {})
    memo.update((id(s), s) for s in _codegen_specs(codegen))
    return copy.deepcopy(codegen, memo)


def _keys(keys: Any, n: int, where: str) -> list[str]:
    if not isinstance(keys, list) or len(keys) != n or not all(is_identifier(k) for k in keys) \
            or len(set(keys)) != n:
        raise CheckpointError(f"{where}: keys must be {n} distinct identifiers, got {keys!r}"[:300])
    return keys


def encode_spec(spec: pytree.TreeSpec, where: str) -> Any:
    """The schema form of a TreeSpec; CheckpointError for structures fxforge cannot rebuild exactly."""
    out = _encode(spec, where)
    if decode_spec(out, where) != spec:
        raise CheckpointError(f"{where}: structure {spec} does not survive the checkpoint schema")
    return out


def _encode(spec: pytree.TreeSpec, where: str) -> Any:
    if spec.is_leaf():
        return "*"
    kids = [_encode(c, where) for c in spec.children()]
    if spec.type in (tuple, list) and spec.context is None:
        return {spec.type.__name__: kids}
    keys = _keys(list(spec.context) if isinstance(spec.context, list) else None, len(kids), where)
    if spec.type is dict:
        return {"dict": [[k, c] for k, c in zip(keys, kids)]}
    name = targets.output_class_name(spec.type)
    if name is None:
        raise CheckpointError(f"{where}: pytree type {spec.type.__module__}.{spec.type.__qualname__} is not an "
                              "allowed output class; register it with fxforge.graph.targets.register_pytree_type")
    return {"output": name, "fields": [[k, c] for k, c in zip(keys, kids)]}


def decode_spec(doc: Any, where: str) -> pytree.TreeSpec:
    """Rebuild a TreeSpec from the schema; every type is tuple, list, dict or an allowed output class."""
    if doc == "*":
        return _LEAF
    if not isinstance(doc, dict) or len(doc) not in (1, 2):
        raise CheckpointError(f"{where}: malformed structure {doc!r}"[:300])
    if len(doc) == 1 and ("tuple" in doc or "list" in doc):
        (kind, kids), = doc.items()
        if not isinstance(kids, list):
            raise CheckpointError(f"{where}: {kind} children must be a list")
        return pytree.TreeSpec(tuple if kind == "tuple" else list, None, [decode_spec(c, where) for c in kids])
    if set(doc) == {"dict"} or set(doc) == {"output", "fields"}:
        pairs = doc.get("dict", doc.get("fields"))
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise CheckpointError(f"{where}: entries must be [key, structure] pairs")
        keys = _keys([p[0] for p in pairs], len(pairs), where)
        kids = [decode_spec(p[1], where) for p in pairs]
        cls: type = dict if "dict" in doc else targets.resolve_output_class(doc["output"], keys)
        return pytree.TreeSpec(cls, list(keys), kids)
    raise CheckpointError(f"{where}: malformed structure {doc!r}"[:300])


def translate_v1_spec(old: Any, where: str) -> Any:
    """Strictly translate a schema-1 ``treespec_dumps`` payload into the new schema (never loaded by torch)."""
    if not (isinstance(old, list) and len(old) == 2 and old[0] == 1 and type(old[0]) is int):
        raise CheckpointError(f"{where}: unsupported schema-1 structure (protocol must be 1)")
    return _translate(old[1], where)


def _translate(node: Any, where: str) -> Any:
    if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"} \
            or not isinstance(node["children_spec"], list):
        raise CheckpointError(f"{where}: malformed schema-1 structure node")
    kind, context, kids = node["type"], node["context"], node["children_spec"]
    if kind is None:
        if context is not None or kids:
            raise CheckpointError(f"{where}: malformed schema-1 leaf")
        return "*"
    children = [_translate(c, where) for c in kids]
    if kind in ("builtins.tuple", "builtins.list") and context == "null":
        return {kind.removeprefix("builtins."): children}
    if not isinstance(context, str):
        raise CheckpointError(f"{where}: schema-1 context of {kind!r} must be a JSON string")
    try:
        keys = json.loads(context)
    except ValueError:
        raise CheckpointError(f"{where}: schema-1 context of {kind!r} is not JSON") from None
    pairs = [[k, c] for k, c in zip(_keys(keys, len(children), where), children)]
    if kind == "builtins.dict":
        return {"dict": pairs}
    targets.resolve_output_class(kind, keys)
    return {"output": kind, "fields": pairs}
