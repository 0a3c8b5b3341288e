"""Which graph values are parameters: a get_attr, or a view / slice / split / cast of one.

nn.MultiheadAttention reaches ``aten.linear`` with ``split_with_sizes(in_proj_weight)[0]`` or
``chunk(in_proj_bias, 3)[1]``, not the parameter node itself. Such an operand is still a weight: its
quantizer takes the scale from the tensor on every call (as a quantized layer's weight does), never a
static activation scale from calibration. Only ops that rearrange, select or cast the one tensor they
read are followed, so an activation never passes for a parameter.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...graph.metadata import get_meta, has_meta

__all__ = ["from_parameter"]

# Ops whose result is (a view, slice, copy, tiling or cast of) their first operand; the other arguments are sizes,
# dims, indices or dtypes. aten overload packets, Tensor methods and torch functions share these names.
_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "swapaxes", "permute", "contiguous", "clone", "detach",
    "alias", "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "tensor_split",
    "flatten", "unflatten", "squeeze", "unsqueeze", "expand", "repeat", "tile", "movedim", "_to_copy", "to",
    "float", "half", "bfloat16", "double", "type", "lift_fresh_copy", "numpy_T", "matrix_H",
})
# Ops that read only the shape / dtype of their second operand (its values never reach the result).
_LIKE_OPS = frozenset({"view_as", "reshape_as", "expand_as", "type_as"})
_ATTRS = frozenset({"T", "mT", "data"})  # getattr(param, "T") in fx-traced graphs


def _op_name(node: fx.Node) -> str | None:
    """The op's name when it is an aten op, a Tensor method or a torch function (None otherwise)."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__ if target._qualified_op_name.startswith("aten::") else None
    name = getattr(target, "__name__", None)
    if name is not None and target in (getattr(torch, name, None), getattr(torch.Tensor, name, None)):
        return str(name)
    return None


def _tensor_valued(value: Any) -> bool:
    """Does ``value`` (an argument) hold a tensor-valued node? (sizes and SymInts are not tensors)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if val is not None:
            return isinstance(val, torch.Tensor)
        if has_meta(value):  # fx-traced graphs: the metadata passes recorded what each result is
            result = get_meta(value).common.results.get("data_out_0")
            return result is None or result.type == "tensor"
        return True  # unknown: not followed, so the operand keeps the activation behaviour
    if isinstance(value, list | tuple):
        return any(_tensor_valued(v) for v in value)
    if isinstance(value, slice):
        return any(_tensor_valued(v) for v in (value.start, value.stop, value.step))
    return False


def _source(node: fx.Node) -> fx.Node | None:
    """The node whose values ``node`` rearranges (its first operand), or None when it computes new values."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first, rest = node.args[0], (*node.args[1:], *node.kwargs.values())
    if node.target is operator.getitem:  # an output of split/chunk, or param[idx] with no tensor index
        return None if _tensor_valued(rest) else first
    if node.target is getattr:
        return first if len(node.args) == 2 and node.args[1] in _ATTRS else None
    name = _op_name(node)
    if name in _LIKE_OPS:
        return first
    if name in _VIEW_OPS and not _tensor_valued(rest):
        return first
    return None


def from_parameter(node: Any) -> bool:
    """Is ``node`` a parameter / buffer (get_attr), or reached from one only through view, slice, split or
    cast ops? Such an operand is quantized as a weight: scale from its own values, no calibration."""
    seen: set[fx.Node] = set()
    while isinstance(node, fx.Node) and node not in seen:
        if node.op == "get_attr":
            return True
        seen.add(node)
        node = _source(node)
    return False
