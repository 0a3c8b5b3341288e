"""Architecture cache: re-capturing the same architecture reuses the normalised graph, bound to the new weights.

Search and sweeps capture many models that differ only in their weights. The key is everything that can
change what tracing produces: every module's class, path, mode and plain attributes (HF configs by their
full JSON, dataclass configs by their fields), every parameter and buffer's name, shape, dtype, device,
``requires_grad`` and which names share a tensor, the example inputs' structure, shapes and dtypes, the
capture settings and torch's global grad mode and default dtype. A value the key cannot describe
exactly (a lambda, a bound method patched onto an instance, a hook) disables the cache for that capture
-- a miss is slow, a wrong hit would be a wrong graph. The cached template holds no reference to the
model it came from: a hit binds the graph's call_module / get_attr targets to the new model's own modules
and tensors at the same paths (constants and modules normalisation created are copied per hit; a module
held as its torch.nn base, graph/nn_base, is held afresh from the new model's).

What the key cannot see: module-level globals read by a forward, and a class whose code changed in
place (a reloaded module with the same class object). ``capture(..., cache=False)`` skips the cache.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
import typing
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .inputs import ExampleInputs
from .nn_base import as_nn_base, is_held_copy
from .normalize_hf import is_hf_conv1d, linear_from_conv1d
from .treespec import copy_codegen

__all__ = ["architecture_key", "lookup", "store", "clear_capture_cache", "capture_cache_size"]

MAX_ENTRIES = 8
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}


class _Unkeyable(Exception):
    """A value the key cannot describe exactly."""


@dataclass(frozen=True)
class _Template:
    graph: fx.Graph
    bindings: tuple[tuple[str, str, Any], ...]  # (target, kind, payload); kinds: module, conv1d, tensor, own
    class_name: str
    frontend: str
    notes: tuple[str, ...]
    # per fx-made container (the root and the plain nn.Modules between it and the model's modules): the order
    # of its children, parameters and buffers, so a hit's named_parameters()/state_dict() order is a fresh one's
    order: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = dataclasses.field(default_factory=dict)


def _container_order(gm: nn.Module) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    return {path: (tuple(m._modules), tuple(m._parameters), tuple(m._buffers))
            for path, m in gm.named_modules() if m is gm or type(m) is nn.Module}


def _reorder(gm: nn.Module, order: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]) -> None:
    for path, (modules, params, buffers) in order.items():
        m = gm.get_submodule(path) if path else gm
        for attr, names in (("_modules", modules), ("_parameters", params), ("_buffers", buffers)):
            current = getattr(m, attr)
            ordered = {k: current[k] for k in names if k in current}
            ordered.update((k, v) for k, v in current.items() if k not in ordered)
            current.clear()
            current.update(ordered)


_CACHE: OrderedDict[Hashable, _Template] = OrderedDict()


def clear_capture_cache() -> None:
    """Forget every cached architecture."""
    _CACHE.clear()


def capture_cache_size() -> int:
    return len(_CACHE)


def _value_key(v: Any, memo: dict[int, Hashable]) -> Hashable:
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return (type(v).__name__, v)
    if isinstance(v, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return ("torch", str(v))
    if isinstance(v, enum.Enum):
        return (type(v), v.name)
    if isinstance(v, type):
        return ("class", v)
    if id(v) in memo:
        return memo[id(v)]
    key: Hashable
    if isinstance(v, tuple | list):
        key = (type(v).__name__, tuple(_value_key(x, memo) for x in v))
    elif isinstance(v, set | frozenset):
        key = ("set", tuple(sorted(repr(_value_key(x, memo)) for x in v)))
    elif isinstance(v, dict):
        key = ("dict", tuple((_value_key(k, memo), _value_key(x, memo)) for k, x in v.items()))
    elif isinstance(v, torch.Tensor):
        key = ("tensor", tuple(v.shape), v.dtype, str(v.device), v.requires_grad)
    elif callable(getattr(v, "to_json_string", None)) and hasattr(v, "to_dict"):  # HF configs
        try:
            # private fields too: the JSON leaves out e.g. _attn_implementation_internal (eager vs SDPA graphs)
            private = tuple((k, _value_key(x, memo)) for k, x in sorted(vars(v).items()) if k.startswith("_"))
            key = ("config", type(v), v.to_json_string(use_diff=False), private)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot key"
            raise _Unkeyable(f"{type(v).__name__} config: {exc}") from None
    elif dataclasses.is_dataclass(v):
        key = ("dataclass", type(v), tuple((f.name, _value_key(getattr(v, f.name), memo))
                                           for f in dataclasses.fields(v)))
    elif isinstance(v, types.FunctionType):
        if "<" in v.__qualname__ or v.__closure__:
            raise _Unkeyable(f"function {v.__qualname__} (a lambda, local function or closure)")
        key = ("function", v.__module__, v.__qualname__)
    elif isinstance(v, types.BuiltinFunctionType):
        key = ("builtin", getattr(v, "__module__", None), v.__qualname__)
    else:
        raise _Unkeyable(f"a {type(v).__module__}.{type(v).__qualname__}")
    memo[id(v)] = key
    return key


def _module_key(model: nn.Module, memo: dict[int, Hashable]) -> Hashable:
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        raise _Unkeyable("global forward hooks are registered")
    entries = []
    for path, m in model.named_modules(remove_duplicate=False):
        if m._forward_hooks or m._forward_pre_hooks:
            raise _Unkeyable(f"module '{path}' has forward hooks")
        attrs = []
        for name, value in m.__dict__.items():
            if name in _MODULE_INTERNALS:
                continue
            try:
                attrs.append((name, _value_key(value, memo)))
            except _Unkeyable as exc:
                raise _Unkeyable(f"module '{path}' attribute {name!r} is {exc}") from None
        entries.append((path, type(m), m.training, tuple(attrs), tuple(sorted(m._non_persistent_buffers_set))))
    first: dict[int, str] = {}
    tensors = []
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        tensors.append((name, tuple(t.shape), t.dtype, str(t.device), t.requires_grad, first.setdefault(id(t), name)))
    return (tuple(entries), tuple(tensors))


def architecture_key(model: nn.Module, example: ExampleInputs | None,
                     settings: Hashable) -> tuple[Hashable | None, str]:
    """(key, "") for a model the cache can serve, or (None, why not)."""
    memo: dict[int, Hashable] = {}
    try:
        inputs = None if example is None else (
            tuple(_value_key(a, memo) for a in example.args),
            tuple((k, _value_key(v, memo)) for k, v in example.kwargs.items()),
        )
        key = (type(model), _module_key(model, memo), inputs, settings, torch.is_grad_enabled(),
               torch.get_default_dtype())
        hash(key)
    except (_Unkeyable, TypeError) as exc:
        return None, f"capture cache not used: {exc}"
    return key, ""


def _attr(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def _binding(gm: fx.GraphModule, model: nn.Module, node: fx.Node, storages: set[int]) -> tuple[str, str, Any] | None:
    target = str(node.target)
    obj = _attr(gm, target)
    original = _attr(model, target)
    if obj is not None and obj is original:
        return (target, "module" if isinstance(obj, nn.Module) else "tensor", target)
    conv_weight = getattr(original, "weight", None) if isinstance(original, nn.Module) and is_hf_conv1d(original) \
        else None
    if isinstance(obj, nn.Linear) and isinstance(conv_weight, torch.Tensor) and \
            obj.weight.data_ptr() == conv_weight.data_ptr():
        return (target, "conv1d", target)
    if is_held_copy(obj, original):
        return (target, "nn_base", target)
    tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, nn.Module) else [obj]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or \
            any(t.untyped_storage().data_ptr() in storages for t in tensors):
        return None  # holds (part of) the model's weights in a way a rebind cannot reproduce
    return (target, "own", copy.deepcopy(obj))


def _fresh_graph(graph: fx.Graph) -> fx.Graph:
    """A node-by-node copy (fx's own deepcopy, but sharing the codegen's immutable pytree specs: copying them
    costs time and deprecation warnings)."""
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    copied = new.graph_copy(graph, {}, return_output_node=True)
    new._codegen = copy_codegen(graph._codegen)
    if copied is not None:
        value, old_output = typing.cast(tuple[Any, fx.Node], copied)  # return_output_node=True: (value, node)
        new.output(value, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
    for node in new.nodes:
        if "nn_module_stack" in node.meta:
            node.meta["nn_module_stack"] = dict(node.meta["nn_module_stack"])
    return new


def store(key: Hashable, gm: fx.GraphModule, model: nn.Module, frontend: str, notes: tuple[str, ...]) -> bool:
    """Remember ``gm`` (just captured from ``model``) under ``key``; False when it cannot be rebound safely."""
    storages = _storages(model)
    bindings: dict[str, tuple[str, str, Any]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and str(node.target) not in bindings:
            bound = _binding(gm, model, node, storages)
            if bound is None:
                return False
            bindings[str(node.target)] = bound
    _CACHE[key] = _Template(_fresh_graph(gm.graph), tuple(bindings.values()), type(gm).__name__, frontend, notes,
                            _container_order(gm))
    _CACHE.move_to_end(key)
    while len(_CACHE) > MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return True


def lookup(key: Hashable, model: nn.Module) -> tuple[fx.GraphModule, str, tuple[str, ...]] | None:
    """The cached graph for ``key`` bound to ``model``'s modules and tensors, its frontend and notes."""
    template = _CACHE.get(key)
    if template is None:
        return None
    _CACHE.move_to_end(key)
    root: dict[str, Any] = {}
    for target, kind, payload in template.bindings:
        if kind in ("module", "tensor"):
            root[target] = _attr(model, payload)
        elif kind == "conv1d":
            root[target] = linear_from_conv1d(model.get_submodule(payload))
        elif kind == "nn_base":
            root[target] = as_nn_base(model.get_submodule(payload))
        else:
            root[target] = copy.deepcopy(payload)
        if root[target] is None:
            return None
    gm = fx.GraphModule(root, _fresh_graph(template.graph), class_name=template.class_name)
    _reorder(gm, template.order)
    gm.train(model.training)
    return gm, template.frontend, template.notes
