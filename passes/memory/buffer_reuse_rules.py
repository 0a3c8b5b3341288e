"""What buffer_reuse_transform_pass may rewrite, into what, and the value checks that keep it bit-identical.

Two rewrite kinds. *In place*: an elementwise op (relu, sigmoid, tanh, gelu, silu, add, mul, sub, div, at the
ATen level, as torch / operator functions, Tensor methods or activation modules) becomes its in-place form
writing into one operand (either operand of add / mul when ``alpha`` is 1: IEEE addition and multiplication
are commutative, so ``b.add_(a)`` is bit for bit ``a + b``). *Out*: a matrix product (mm, bmm, matmul)
writes into a dead buffer through ``out=``. The same kernel runs on the same values either way; the checks
below refuse what would change the result: broadcasting into the overwritten operand (at the example shape
or, through size-1 dimensions, at another), dtype promotion, another layout, integer or bool dtypes,
operands sharing storage, a partial view of a storage.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
CallOp = Literal["call_function", "call_method"]

__all__ = ["InPlace", "Match", "OutForm", "match_node", "out_problem", "overwrite_problem"]


@dataclass(frozen=True)
class InPlace:
    """Overwrite ``operand`` with the op's result: the node becomes ``op(target)(*args, **kwargs)``;
    ``others`` are the other values the op reads."""

    operand: fx.Node
    others: tuple[Any, ...]
    op: CallOp
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OutForm:
    """A matrix product that can write into a buffer: ``build(out)`` gives (op, target, args, kwargs)."""

    build: Callable[[fx.Node], tuple[CallOp, Any, tuple[Any, ...], dict[str, Any]]]
    operands: tuple[Any, ...]


@dataclass(frozen=True)
class Match:
    """A candidate node: its in-place options (tried in order), its out= form, or why it is left as is."""

    options: tuple[InPlace, ...] = ()
    out: OutForm | None = None
    skip: str | None = None


_ATEN_UNARY = {aten.relu.default: aten.relu_.default, aten.sigmoid.default: aten.sigmoid_.default,
               aten.tanh.default: aten.tanh_.default, aten.gelu.default: aten.gelu_.default,
               aten.silu.default: aten.silu_.default}
_ATEN_BINARY = {aten.add.Tensor: aten.add_.Tensor, aten.mul.Tensor: aten.mul_.Tensor,
                aten.sub.Tensor: aten.sub_.Tensor, aten.div.Tensor: aten.div_.Tensor}
_COMMUTATIVE = {"add", "mul"}
_METHOD_UNARY = {"relu": "relu_", "sigmoid": "sigmoid_", "tanh": "tanh_"}
_FUNC_UNARY: dict[Any, str] = {torch.relu: "relu_", F.relu: "relu_", torch.sigmoid: "sigmoid_",
                               F.sigmoid: "sigmoid_", torch.tanh: "tanh_", F.tanh: "tanh_"}
_FUNC_ATEN_UNARY: dict[Any, Any] = {F.gelu: aten.gelu_.default, F.silu: aten.silu_.default}
_FUNC_BINARY: dict[Any, str] = {operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul",
                                operator.sub: "sub", torch.sub: "sub", operator.truediv: "div", torch.div: "div"}
_METHOD_BINARY = {"add", "mul", "sub", "div"}
_MODULE_UNARY: dict[type[nn.Module], str] = {nn.ReLU: "relu_", nn.Sigmoid: "sigmoid_", nn.Tanh: "tanh_"}
_ATEN_PRODUCTS = {aten.mm.default: aten.mm.out, aten.bmm.default: aten.bmm.out, aten.matmul.default: aten.matmul.out}
_FUNC_PRODUCTS: dict[Any, Any] = {torch.matmul: torch.matmul, operator.matmul: torch.matmul, torch.mm: torch.mm,
                                  torch.bmm: torch.bmm}
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_EVAL_DROPOUT = "dropout in eval mode returns its input itself: there is no buffer to reuse"


def _binary(a: Any, b: Any, commutative: bool, alpha: Any,
            build: Callable[[fx.Node, Any, dict[str, Any]], InPlace]) -> Match:
    """Options for ``a op b``: overwrite ``a``; or ``b`` when the op commutes and alpha is 1."""
    options = []
    kwargs = {} if alpha is None else {"alpha": alpha}
    if isinstance(a, fx.Node):
        options.append(build(a, b, kwargs))
    if commutative and isinstance(b, fx.Node) and alpha in (None, 1):
        options.append(build(b, a, {}))
    return Match(options=tuple(options), skip=None if options else "no tensor operand it could overwrite")


def _aten(node: fx.Node) -> Match | None:
    target = node.target
    if target in _ATEN_UNARY and len(node.args) == 1 and set(node.kwargs) <= {"approximate"}:
        x = node.args[0]
        if isinstance(x, fx.Node):
            return Match(options=(InPlace(x, (), "call_function", _ATEN_UNARY[target], (x,), dict(node.kwargs)),))
    if target in _ATEN_BINARY and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
        op = _ATEN_BINARY[target]
        name = target._schema.name.split("::")[1]
        return _binary(*node.args, name in _COMMUTATIVE, node.kwargs.get("alpha"),
                       lambda x, y, kw: InPlace(x, (y,), "call_function", op, (x, y), kw))
    if target in _ATEN_PRODUCTS and len(node.args) == 2 and not node.kwargs:
        a, b, out_op = node.args[0], node.args[1], _ATEN_PRODUCTS[target]
        return Match(out=OutForm(lambda out: ("call_function", out_op, (a, b), {"out": out}), (a, b)))
    if target in (aten.dropout.default, aten.native_dropout.default) and node.args[2:3] == (False,):
        return Match(skip=_EVAL_DROPOUT)
    return None


def _function(node: fx.Node) -> Match | None:
    target, args, kwargs = node.target, node.args, dict(node.kwargs)
    if kwargs.get("inplace") is True or (target in (F.relu, F.silu) and args[1:2] == (True,)):
        return Match(skip="already in place")
    kwargs.pop("inplace", None)
    x = args[0] if len(args) == 1 and isinstance(args[0], fx.Node) else None
    if target in _FUNC_UNARY and x is not None and not kwargs:
        return Match(options=(InPlace(x, (), "call_method", _FUNC_UNARY[target], (x,)),))
    if target in _FUNC_ATEN_UNARY and x is not None and set(kwargs) <= {"approximate"}:
        return Match(options=(InPlace(x, (), "call_function", _FUNC_ATEN_UNARY[target], (x,), kwargs),))
    if target in _FUNC_BINARY and len(args) == 2 and set(kwargs) <= {"alpha"}:
        name = _FUNC_BINARY[target]
        return _binary(*args, name in _COMMUTATIVE, kwargs.get("alpha"),
                       lambda x, y, kw: InPlace(x, (y,), "call_method", name + "_", (x, y), kw))
    if target in _FUNC_PRODUCTS and len(args) == 2 and not kwargs:
        a, b, fn = args[0], args[1], _FUNC_PRODUCTS[target]
        return Match(out=OutForm(lambda out: ("call_function", fn, (a, b), {"out": out}), (a, b)))
    if target is F.dropout:
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        return Match(skip=_EVAL_DROPOUT) if training is False else None
    return None


def _method(node: fx.Node) -> Match | None:
    name, args, kwargs = str(node.target), node.args, dict(node.kwargs)
    if name in _METHOD_UNARY and len(args) == 1 and not kwargs and isinstance(args[0], fx.Node):
        return Match(options=(InPlace(args[0], (), "call_method", _METHOD_UNARY[name], (args[0],)),))
    if name in _METHOD_BINARY and len(args) == 2 and set(kwargs) <= {"alpha"}:
        return _binary(*args, name in _COMMUTATIVE, kwargs.get("alpha"),
                       lambda x, y, kw: InPlace(x, (y,), "call_method", name + "_", (x, y), kw))
    if name == "matmul" and len(args) == 2 and not kwargs:
        a, b = args
        return Match(out=OutForm(lambda out: ("call_function", torch.matmul, (a, b), {"out": out}), (a, b)))
    return None


def _module(node: fx.Node, gm: fx.GraphModule) -> Match | None:
    module = gm.get_submodule(str(node.target))
    kind = type(module)
    if kind not in (*_MODULE_UNARY, nn.GELU, nn.SiLU, *_DROPOUT):
        return None
    if kind in _DROPOUT:
        return Match(skip=_EVAL_DROPOUT)
    if module._forward_hooks or module._forward_pre_hooks:
        return Match(skip=f"module {node.target!r} has forward hooks a call_function would drop")
    if getattr(module, "inplace", False):
        return Match(skip="already in place")
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    x = node.args[0]
    if kind is nn.GELU:
        return Match(options=(InPlace(x, (), "call_function", aten.gelu_.default, (x,),
                                      {"approximate": module.approximate}),))
    if kind is nn.SiLU:
        return Match(options=(InPlace(x, (), "call_function", aten.silu_.default, (x,)),))
    return Match(options=(InPlace(x, (), "call_method", _MODULE_UNARY[kind], (x,)),))


def match_node(node: fx.Node, gm: fx.GraphModule) -> Match | None:
    """The rewrite options of ``node`` (None: not an op this pass knows)."""
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return _aten(node)
        return _function(node)
    if node.op == "call_method":
        return _method(node)
    if node.op == "call_module":
        return _module(node, gm)
    return None


def _partial(t: torch.Tensor) -> bool:
    """Whether ``t`` sees only part of its storage (a slice, a split or chunk piece, an offset view)."""
    return t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def overwrite_problem(x: Any, result: Any, others: list[Any]) -> str | None:
    """Why writing ``result`` into ``x`` in place would not be bit-identical or safe (None: it would be)."""
    if not isinstance(x, torch.Tensor) or not isinstance(result, torch.Tensor):
        return "not a single tensor"
    if not (x.is_floating_point() or x.is_complex()):
        return f"{x.dtype} is an integer or bool dtype"
    if result.dtype != x.dtype:
        return f"dtype promotion: the result is {result.dtype}, the operand {x.dtype}"
    if result.shape != x.shape:
        return f"broadcast: the result's shape {tuple(result.shape)} is not the operand's {tuple(x.shape)}"
    if result.stride() != x.stride():
        return f"layout: the result's strides {result.stride()} are not the operand's {x.stride()}"
    if _partial(x):
        return "a partial view of its storage (slice, split or offset)"
    for y in others:
        if not isinstance(y, torch.Tensor):
            continue
        if _ptr(y) == _ptr(x):
            return "its operands share storage"
        if any(x.shape[-k] == 1 and y.shape[-k] == 1 for k in range(1, min(x.dim(), y.dim()) + 1)):
            return ("size-1 dimensions in both operands at the example shape: at another shape the other operand "
                    "could broadcast into it (capture with larger example inputs)")
    return None


def out_problem(buffer: Any, result: Any, operands: list[Any]) -> str | None:
    """Why ``result`` cannot be written into ``buffer`` through ``out=`` (None: it can, bit for bit)."""
    if not isinstance(buffer, torch.Tensor) or not isinstance(result, torch.Tensor):
        return "not a single tensor"
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands):
        return ("an operand requires grad: autograd refuses out= in grad mode (freeze the parameters, e.g. "
                "with freeze_transform_pass, to allow it)")
    if buffer.dtype != result.dtype or buffer.shape != result.shape:
        return "no dead buffer of the result's shape and dtype"
    if not (buffer.is_contiguous() and result.is_contiguous()) or _partial(buffer):
        return "no dead contiguous buffer of its own storage"
    if any(isinstance(t, torch.Tensor) and _ptr(t) == _ptr(buffer) for t in operands):
        return "the buffer is an operand"
    return None
