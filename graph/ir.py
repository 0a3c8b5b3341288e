"""MASE-style IR on top of torch.fx: each node gets a kind and a canonical op name.

The canonical name does not depend on the frontend: ``F.linear``, ``aten.linear.default`` and a call
to an ``nn.Linear`` submodule are all ``linear``; ``torch.fft.rfft`` and ``aten.fft_rfft`` are
``fft_rfft``; ``operator.add``, ``torch.add``, ``Tensor.add`` and ``aten.add.Tensor`` are ``add``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .metadata import NodeKind

# Module types whose canonical op differs from the snake_case of their class name.
_MODULE_OPS: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.Embedding: "embedding",
    nn.LayerNorm: "layer_norm",
    nn.GroupNorm: "group_norm",
    nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm",
    nn.Dropout: "dropout",
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
    nn.Softmax: "softmax",
    nn.LogSoftmax: "log_softmax",
    nn.Identity: "identity",
}

# operator / builtin callables → canonical names.
_OPERATOR_OPS: dict[Callable[..., Any], str] = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.floordiv: "floordiv",
    operator.mod: "remainder",
    operator.pow: "pow",
    operator.neg: "neg",
    operator.matmul: "matmul",
    operator.getitem: "getitem",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "and",
    operator.or_: "or",
    operator.invert: "bitwise_not",
    getattr: "getattr",
}

# aten names that differ from the public spelling.
_ALIASES = {
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "true_divide": "div",
    "divide": "div",
    "multiply": "mul",
    "subtract": "sub",
    "__and__": "and",
    "__or__": "or",
    "_to_copy": "to",
    "native_layer_norm": "layer_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
}

_FUNCTIONAL_NAMES = frozenset(name for name in dir(F) if not name.startswith("_"))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def canonical_function_name(target: Any) -> str:
    """Canonical op name of a call_function target (torch function, aten op or operator)."""
    if target in _OPERATOR_OPS:
        return _OPERATOR_OPS[target]
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        name = target._schema.name.split("::", 1)[1] if isinstance(target, torch._ops.OpOverload) else (
            target._qualified_op_name.split("::", 1)[1]
        )
    else:
        name = getattr(target, "__name__", None) or type(target).__name__
    name = _ALIASES.get(name, name)
    return name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name


def module_op_name(module: nn.Module) -> str:
    """Canonical op name of a call_module node's module."""
    for cls in type(module).__mro__:
        if cls in _MODULE_OPS:
            return _MODULE_OPS[cls]
    op = getattr(type(module), "fxforge_op", None)
    return op if isinstance(op, str) else _snake(type(module).__name__)


def module_type_name(module: nn.Module | type) -> str:
    """The dotted class path recorded as a call_module node's ``module_type`` (the one spelling)."""
    cls = module if isinstance(module, type) else type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def classify(node: fx.Node, root: nn.Module) -> tuple[NodeKind, str]:
    """(kind, canonical op) of a node.

    Kind follows MASE: an op with a ``torch.nn.functional`` counterpart (as a function or as the
    module that wraps it) is ``module_related_func``; any other module is ``module``; other calls are
    ``builtin_func``.
    """
    if node.op == "placeholder":
        return NodeKind.PLACEHOLDER, "placeholder"
    if node.op == "get_attr":
        return NodeKind.GET_ATTR, "get_attr"
    if node.op == "output":
        return NodeKind.OUTPUT, "output"
    if node.op == "call_module":
        op = module_op_name(root.get_submodule(str(node.target)))
        kind = NodeKind.MODULE_RELATED_FUNC if op in _FUNCTIONAL_NAMES else NodeKind.MODULE
        return kind, op
    if node.op == "call_method":
        op = _ALIASES.get(str(node.target), str(node.target))
        op = op.rstrip("_") if op.endswith("_") and not op.startswith("_") else op
    else:
        op = canonical_function_name(node.target)
    kind = NodeKind.MODULE_RELATED_FUNC if op in _FUNCTIONAL_NAMES else NodeKind.BUILTIN_FUNC
    return kind, op
