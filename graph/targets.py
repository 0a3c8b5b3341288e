"""The allowlist of everything a checkpoint may name: call targets, module classes and pytree types.

Loading a checkpoint resolves every string through this module and nothing else, so a checkpoint can
only call torch ops (aten/prims/fxforge, and the individually audited ops of :mod:`.known_ops`), public
tensor functions, ``operator`` arithmetic, Tensor methods, and functions, modules and pytree types that
fxforge or the user registered here. Extending it (e.g. a LoRA or a quantized linear) is one call:
:func:`register_module`, :func:`register_function`, :func:`register_op_namespace` or
:func:`register_pytree_type`.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import keyword
import math
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from . import known_ops
from .modules import ScaledDotProductAttention

F_ = TypeVar("F_", bound=Callable[..., Any])
M_ = TypeVar("M_", bound=nn.Module)

_IDENT = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")
_HOW = (
    "register it with fxforge.graph.targets.{fn}(...) before saving and loading, if you trust it"
)


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message names the file or target and the fix."""


def is_identifier(name: Any) -> bool:
    """True for a plain ASCII identifier that is not a Python keyword (``\\A...\\Z``: no trailing newline)."""
    return isinstance(name, str) and _IDENT.fullmatch(name) is not None and not keyword.iskeyword(name) \
        and not keyword.issoftkeyword(name)


@dataclass(frozen=True)
class ModuleSpec(Generic[M_]):
    """How a module class is written and rebuilt: ``to_config`` → JSON dict → ``from_config``.

    A container (both callables None) is rebuilt as ``cls()``; its children, parameters and buffers
    are attached from the checkpoint.
    """

    name: str
    cls: type[M_]
    to_config: Callable[[M_], dict[str, Any]] | None = None
    from_config: Callable[[dict[str, Any]], M_] | None = None
    keys: frozenset[str] | None = None  # the constructor keys a config may hold (None: from_config's own check)

    @property
    def container(self) -> bool:
        """True when the class is rebuilt empty and filled from the checkpoint (no config)."""
        return self.from_config is None


# -- registries -------------------------------------------------------------------------------------
_USER_FUNCTIONS: dict[str, Callable[..., Any]] = {}
_MODULES_BY_NAME: dict[str, ModuleSpec[Any]] = {}  # each spec's callables take its own cls
_MODULES_BY_CLASS: dict[type[nn.Module], ModuleSpec[Any]] = {}
_OP_NAMESPACES: set[str] = {"aten", "prims", "fxforge"}
# Output classes (pytree node types) a graph's output structure may name, beyond HF ModelOutputs.
_PYTREE_TYPES: set[str] = set()

# Ops and methods that change state outside the tensors they compute on: autograd flags and tensor
# metadata of their argument (a parameter's requires_grad, its storage), hooks, files, numpy.
_STATE_CHANGING = frozenset({
    "requires_grad_", "resize_", "resize_as_", "as_strided_", "set_", "share_memory_",
    "retain_grad", "backward", "_backward", "record_stream", "set_data", "_coalesced_", "_fix_weakref",
})
_DENIED_OPS = _STATE_CHANGING | {"from_file", "_nested_from_file", "save", "load"}
# Ops with no tensor in or out that only raise: what torch.export emits for shape checks.
_ASSERT_OPS = ("_assert", "sym_constrain_range", "_linalg_check_errors")
_DENIED_METHODS = _STATE_CHANGING | {
    "apply_", "map_", "map2_", "register_hook", "register_post_accumulate_grad_hook", "numpy", "storage",
    "untyped_storage", "storage_type", "module_load", "type", "pin_memory", "cuda", "xpu", "ipu", "mtia",
}
# Factories take no tensor, so torch.overrides does not list them; torch._assert is what fx emits for asserts.
_FACTORIES = (
    "arange", "zeros", "ones", "full", "eye", "empty", "empty_strided", "rand", "randn", "randint",
    "randperm", "linspace", "logspace", "tensor", "as_tensor", "scalar_tensor", "zeros_like",
    "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like", "tril_indices",
    "triu_indices", "complex", "polar", "_assert",
)
_F_EXTRAS = ("hardsigmoid", "hardswish", "sigmoid", "tanh", "relu_", "elu_", "celu_", "selu_",
             "leaky_relu_", "hardtanh_", "rrelu_", "threshold_")
_OPERATORS = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "matmul", "getitem",
    "setitem", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "inv", "not_",
    "lshift", "rshift", "truth", "contains", "concat", "index", "iadd", "isub", "imul", "itruediv",
    "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor", "ilshift", "irshift",
)
_MATH = ("sqrt", "floor", "ceil", "trunc", "log", "exp", "pow", "isfinite", "isinf", "isnan")
_DENIED_TORCH = frozenset({"autocast"})


def register_function(fn: F_ | None = None, *, name: str | None = None) -> Any:
    """Allow ``fn`` as a call_function target under ``name`` (default ``module.qualname``).

    Usable as ``register_function(fn)`` or as a decorator (``@register_function`` /
    ``@register_function(name=...)``); returns ``fn``.
    """
    def add(f: F_) -> F_:
        key = name or f"{f.__module__}.{f.__qualname__}"
        if _USER_FUNCTIONS.get(key, f) is not f:
            raise ValueError(f"function name {key!r} is already registered for {_USER_FUNCTIONS[key]!r}")
        _USER_FUNCTIONS[key] = f
        _reverse_functions.cache_clear()
        return f

    return add if fn is None else add(fn)


def register_module(
    cls: type[M_],
    to_config: Callable[[M_], dict[str, Any]] | None = None,
    from_config: Callable[[dict[str, Any]], M_] | None = None,
    *,
    name: str | None = None,
    keys: Iterable[str] | None = None,
) -> ModuleSpec:
    """Allow module class ``cls`` (exact type, not subclasses) in checkpoints.

    ``to_config(module)`` returns the JSON constructor config; ``from_config(config)`` rebuilds the
    module cheaply (it runs on the meta device; weights are loaded afterwards). Give neither for a
    container built as ``cls()`` whose children and tensors come from the checkpoint. ``keys`` lists
    the constructor keys a config may hold (loading refuses any other, e.g. ``device``/``dtype``).
    """
    if (to_config is None) != (from_config is None):
        raise ValueError("give both to_config and from_config, or neither (a container)")
    key = name or f"{cls.__module__}.{cls.__qualname__}"
    spec = ModuleSpec(key, cls, to_config, from_config, None if keys is None else frozenset(keys))
    old = _MODULES_BY_NAME.get(key)
    if old is not None and old.cls is not cls:
        raise ValueError(f"module name {key!r} is already registered for {old.cls!r}")
    _MODULES_BY_NAME[key] = spec
    _MODULES_BY_CLASS[cls] = spec
    return spec


def register_op_namespace(namespace: str) -> None:
    """Allow every op of ``torch.ops.<namespace>`` (e.g. custom kernels registered with torch.library)."""
    if not _IDENT.match(namespace):
        raise ValueError(f"bad op namespace {namespace!r}")
    _OP_NAMESPACES.add(namespace)


# -- functions --------------------------------------------------------------------------------------
def tensor_methods() -> frozenset[str]:
    """Method names allowed in call_method nodes: public Tensor methods minus the denied ones."""
    return _tensor_methods()


@functools.cache
def _tensor_methods() -> frozenset[str]:
    funcs = torch.overrides.get_overridable_functions().get(torch.Tensor, [])
    names = {getattr(f, "__name__", "") for f in funcs}
    return frozenset(
        n for n in names if _IDENT.match(n) and not n.startswith("_") and n not in _DENIED_METHODS
        and callable(getattr(torch.Tensor, n, None))
    )


@functools.cache
def _builtin_functions() -> dict[str, Callable[..., Any]]:
    """name → callable for torch's public tensor functions, operator, math and builtins.getattr."""
    overridable = torch.overrides.get_overridable_functions()
    table: dict[str, Callable[..., Any]] = {}
    namespaces: tuple[tuple[str, Any, tuple[Any, ...]], ...] = (
        ("torch.nn.functional", F, (F,)),
        ("torch.fft", torch.fft, (torch.fft,)),
        ("torch.linalg", torch.linalg, (torch.linalg,)),
        ("torch.special", torch.special, (torch.special,)),
        ("torch", torch, (torch, torch.functional)),
    )
    for prefix, namespace, keys in namespaces:
        ids = {id(f) for key in keys for f in overridable.get(key, ())}
        for attr in dir(namespace):
            obj = getattr(namespace, attr, None)
            if id(obj) in ids and attr not in _DENIED_TORCH and attr not in _STATE_CHANGING and callable(obj):
                table[f"{prefix}.{attr}"] = obj
    for attr in _FACTORIES:
        table[f"torch.{attr}"] = getattr(torch, attr)
    for attr in _F_EXTRAS:
        table[f"torch.nn.functional.{attr}"] = getattr(F, attr)
    for attr in sorted(_tensor_methods()):
        table[f"torch.Tensor.{attr}"] = getattr(torch.Tensor, attr)
    for attr in _OPERATORS:
        table[f"operator.{attr}"] = getattr(operator, attr)
    for attr in _MATH:
        table[f"math.{attr}"] = getattr(math, attr)
    table["builtins.getattr"] = builtins.getattr
    return table


@functools.cache
def _reverse_functions() -> dict[int, tuple[str, Callable[..., Any]]]:
    out: dict[int, tuple[str, Callable[..., Any]]] = {}
    for table in (_USER_FUNCTIONS, _builtin_functions()):
        for key, fn in table.items():
            out.setdefault(id(fn), (key, fn))
    return out


def _resolve_op(name: str) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket:
    parts = name.split(".")
    if len(parts) not in (4, 5) or parts[:2] != ["torch", "ops"] or not all(_IDENT.match(p) for p in parts[2:]):
        raise CheckpointError(f"malformed op name {name!r}: expected torch.ops.<namespace>.<op>[.<overload>]")
    namespace, op = parts[2:4]
    known = namespace not in _OP_NAMESPACES and known_ops.is_known(namespace, op)  # judged per overload below
    if namespace not in _OP_NAMESPACES and not known:
        raise CheckpointError(
            f"op {name!r} is not allowed: torch.ops.{namespace} is not aten, prims, fxforge or a registered "
            "namespace, and it is not one of the ops fxforge knows (graph/known_ops.py); "
            + _HOW.format(fn="register_op_namespace")
        )
    if op in _DENIED_OPS:
        raise CheckpointError(f"op {name!r} is not allowed in checkpoints (it changes state outside the graph)")
    if known:
        try:
            known_ops.load(namespace, op)  # the table's fixed module only
        except known_ops.KnownOpError as exc:
            raise CheckpointError(f"op {name!r} cannot be loaded: {exc}") from None
    packet = getattr(getattr(torch.ops, namespace), op, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise CheckpointError(f"op {name!r} does not exist in this torch build (or its library is not loaded)")
    if len(parts) == 5 and parts[4] not in packet.overloads():
        raise CheckpointError(f"op {name!r}: no overload {parts[4]!r} in this torch build")
    overloads = [getattr(packet, o) for o in packet.overloads()] if len(parts) == 4 else [getattr(packet, parts[4])]
    unknown = [r for r in map(known_ops.refusal, overloads) if r] if known else []
    if unknown:  # a known op must be exactly the audited one, every overload of a packet
        raise CheckpointError(f"op {name!r} is not allowed in checkpoints: " + "; ".join(unknown))
    reasons = [_global_effect(o) for o in overloads]  # a packet: refused if any overload is a pure side effect
    side_effect = next((r for r in reasons if r and "returns nothing" in r), None)
    reason = side_effect or (reasons[0] if all(reasons) else None)
    if reason:
        raise CheckpointError(f"op {name!r} is not allowed in checkpoints: {reason}")
    return packet if len(parts) == 4 else overloads[0]


def _global_effect(op: torch._ops.OpOverload) -> str | None:
    """Why an op may act on process state rather than compute on tensors (None if it only computes).

    The rule: an op that returns nothing and writes no argument exists only for its side effect
    (printing, seeding, grad mode, saving, backward...); an op with no tensor in or out acts on
    global state (RNG generators, plan caches, flags). Assertions, which only raise, are exempt.
    """
    schema = op._schema
    if op._opname.startswith(_ASSERT_OPS):
        return None
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    if not schema.returns and not writes:
        return "it returns nothing, so it runs only for a side effect on process state"
    if not any("Tensor" in str(x.type) for x in (*schema.arguments, *schema.returns)):
        return "it takes and returns no tensor, so it acts on process state (RNG, flags, caches)"
    return None


def function_name(fn: Any) -> str:
    """The checkpoint name of a call_function target; CheckpointError if it is not allowed."""
    if isinstance(fn, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        namespace, op = fn._qualified_op_name.split("::", 1) if isinstance(fn, torch._ops.OpOverloadPacket) \
            else (fn.namespace, fn._opname)
        name = f"torch.ops.{namespace}.{op}"
        if isinstance(fn, torch._ops.OpOverload):
            name += f".{fn._overloadname}"
        if _resolve_op(name) is not fn:
            raise CheckpointError(f"op {name!r} does not resolve back to {fn!r}")
        return name
    hit = _reverse_functions().get(id(fn))
    if hit is not None and hit[1] is fn:
        return hit[0]
    label = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    raise CheckpointError(f"call target {label} is not in the checkpoint allowlist; "
                          + _HOW.format(fn="register_function"))


def check_op_schema(fn: Any, recorded: Any) -> None:
    """Refuse a node whose recorded op schema is not the live one (checkpoints before it record none)."""
    live = known_ops.op_schema(fn)
    if recorded != live:
        raise CheckpointError(f"recorded schema {recorded!r} does not match the live op's {live!r}"[:400])


def resolve_function(name: str) -> Callable[..., Any]:
    """The callable a checkpoint names; only allowlisted names resolve (nothing is imported)."""
    if not isinstance(name, str):
        raise CheckpointError(f"call target {name!r} is not a name")
    if name.startswith("torch.ops."):
        return _resolve_op(name)
    fn = _USER_FUNCTIONS.get(name) or _builtin_functions().get(name)
    if fn is None:
        raise CheckpointError(f"call target {name!r} is not in the checkpoint allowlist; "
                              + _HOW.format(fn="register_function"))
    return fn


def check_method(name: Any) -> str:
    """Validate a call_method target: a public, allowed Tensor method name."""
    if not isinstance(name, str) or name not in _tensor_methods():
        raise CheckpointError(f"method {name!r} is not an allowed Tensor method for call_method nodes")
    return name


_CALL_CHECKS: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], None]] = {}


def register_call_check(name: str, check: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> None:
    """Validate the arguments of calls to ``name`` when a checkpoint is loaded or saved (``check`` raises
    CheckpointError), so data the call interprets at run time is checked once, before the graph is built."""
    _CALL_CHECKS[name] = check


def check_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Argument rules for targets that need them: ``getattr`` only reads public attributes; the rules
    registered with :func:`register_call_check` (the shape guard's checks)."""
    if name in _CALL_CHECKS:
        _CALL_CHECKS[name](args, kwargs)
    if name == "builtins.getattr":
        attr = args[1] if len(args) > 1 else None
        if kwargs or len(args) not in (2, 3) or not isinstance(attr, str) or not _IDENT.match(attr) \
                or attr.startswith("_"):
            raise CheckpointError(f"getattr may only read public attributes given as a literal, got {attr!r}")


# -- modules ----------------------------------------------------------------------------------------
def module_spec_for(module: nn.Module) -> ModuleSpec:
    """The spec of a module's exact class; CheckpointError if it is not registered."""
    spec = _MODULES_BY_CLASS.get(type(module))
    if spec is None:
        cls = type(module)
        raise CheckpointError(f"module class {cls.__module__}.{cls.__qualname__} is not in the checkpoint "
                              "allowlist; " + _HOW.format(fn="register_module"))
    return spec


def resolve_module(name: Any) -> ModuleSpec:
    """The spec registered under ``name``; CheckpointError for anything else."""
    spec = _MODULES_BY_NAME.get(name) if isinstance(name, str) else None
    if spec is None:
        raise CheckpointError(f"module class {name!r} is not in the checkpoint allowlist; "
                              + _HOW.format(fn="register_module"))
    return spec


def _simple(cls: type[nn.Module], *attrs: str, tuples: tuple[str, ...] = ()) -> None:
    """Register ``cls`` whose constructor takes exactly ``attrs`` (read back from the instance)."""

    def to_config(m: nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a in attrs:
            if a == "bias":
                out[a] = getattr(m, "bias", None) is not None or not getattr(m, "elementwise_affine", True)
            else:
                v = getattr(m, a)
                out[a] = list(v) if isinstance(v, tuple) else v
        return out

    def from_config(config: dict[str, Any]) -> nn.Module:
        kw = {k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in config.items()}
        return cls(**kw)

    register_module(cls, to_config, from_config, name=f"torch.nn.{cls.__name__}", keys=attrs)


_CONV = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "bias",
         "padding_mode")
_simple(nn.Linear, "in_features", "out_features", "bias")
_simple(nn.Embedding, "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
        "scale_grad_by_freq", "sparse")
_simple(nn.Conv1d, *_CONV, tuples=("kernel_size", "stride", "padding", "dilation"))
_simple(nn.Conv2d, *_CONV, tuples=("kernel_size", "stride", "padding", "dilation"))
for _container in (nn.Module, nn.ModuleList, nn.ModuleDict, nn.Sequential):
    register_module(_container, name=f"torch.nn.{_container.__name__}")
register_module(
    ScaledDotProductAttention,
    lambda m: {"dropout_p": m.dropout_p, "is_causal": m.is_causal, "scale": m.scale, "enable_gqa": m.enable_gqa},
    lambda c: ScaledDotProductAttention(**c),
    name="fxforge.ScaledDotProductAttention", keys=("dropout_p", "is_causal", "scale", "enable_gqa"),
)


# -- pytree types -----------------------------------------------------------------------------------
def register_pytree_type(cls_or_name: type | str) -> None:
    """Allow an output class (already registered with torch.utils._pytree, flattened to its field values
    with the field names as context, as HF ModelOutputs are) in a graph's output structure."""
    if isinstance(cls_or_name, str):
        if not all(_IDENT.fullmatch(p) for p in cls_or_name.split(".")):
            raise ValueError(f"bad pytree type name {cls_or_name!r}")
        _PYTREE_TYPES.add(cls_or_name)
        return
    entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls_or_name)
    type_name = entry.serialized_type_name if entry is not None else None
    if not type_name or type_name == pytree.NO_SERIALIZED_TYPE_NAME_FOUND or not dataclasses.is_dataclass(cls_or_name):
        raise ValueError(f"{cls_or_name!r} must be a dataclass registered with torch's pytree (with a "
                         "serialized_type_name) to be an output class")
    _PYTREE_TYPES.add(type_name)


def _is_hf_output(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) and any(
        c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.") for c in cls.__mro__)


def output_class_name(cls: type) -> str | None:
    """The checkpoint name of an allowed output class (an HF ModelOutput or a registered one), else None."""
    entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    name = entry.serialized_type_name if entry is not None else None
    if not name or pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name) is not cls:
        return None
    return name if name in _PYTREE_TYPES or _is_hf_output(cls) else None


@functools.cache
def _register_hf_outputs() -> None:
    """Import transformers' own output module (a fixed name fxforge chooses, never a checkpoint's)."""
    try:
        import transformers.modeling_outputs  # noqa: F401
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def resolve_output_class(name: Any, keys: list[str]) -> type:
    """The output class a checkpoint names, looked up among classes already registered with torch's
    pytree (nothing named by the checkpoint is imported); its fields must include ``keys``."""
    if not isinstance(name, str) or not all(_IDENT.fullmatch(p) for p in name.split(".")):
        raise CheckpointError(f"pytree type {name!r} is not a class name")
    if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE and name.startswith("transformers."):
        _register_hf_outputs()
    cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    if cls is None or output_class_name(cls) != name:
        raise CheckpointError(f"pytree type {name!r} is not in the checkpoint allowlist (an HF ModelOutput or "
                              "a class registered with fxforge.graph.targets.register_pytree_type, already "
                              "imported)")
    fields = {f.name for f in dataclasses.fields(cls)}
    if not set(keys) <= fields:
        raise CheckpointError(f"pytree type {name!r} has no field(s) {sorted(set(keys) - fields)}")
    return cls
