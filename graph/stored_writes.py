"""What a loaded graph's nodes can reach: refuse any write to storage shared with a stored tensor.

A checkpoint's graph may read its parameters, buffers and constants, never change them: a node that
writes in place (``zero_``, ``operator.setitem``, ``operator.iadd``, an ATen op whose schema marks an
argument written, ``out=``, ``inplace=True``, a module built with ``inplace``) must not write a value
that may share storage with a stored tensor. That is decided by what each node can reach, not by its
name: a ``get_attr`` node holds a stored tensor, and an op's result may alias its inputs unless the op
provably allocates (an ATen kernel whose schema returns no alias and that is not a composite which may
hand back its input, or one of the few composites known to compute a new tensor on every path, such as
``matmul``: Falcon adds its residual in place into ``x @ weight.T``; ``einsum`` only with two or more
operands, since one operand may come back as a view of itself), or a call of a module that is exactly
``nn.Linear`` or a convolution (Swinv2 applies ``ReLU(inplace=True)`` to a Linear of a stored table).
Everything else -- views, ``getattr(w, "data")``, ``getitem``, other module calls (a subclass may
override ``forward``), unknown functions -- is assumed to alias. Module
values (a ``get_attr`` of a submodule) are refused outright: a graph calls modules, it never holds them
(``.half()`` on one casts its weights).
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .ir import canonical_function_name
from .targets import CheckpointError

__all__ = ["StoredReach"]

_Op = torch._ops.OpOverload | torch._ops.OpOverloadPacket
# Modules whose forward computes a new tensor on every path (a product or a convolution), by exact class.
_FRESH_MODULES: frozenset[type[nn.Module]] = frozenset({nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d})


@functools.cache
def _operator_writers() -> frozenset[Callable[..., Any]]:
    """``operator``'s functions that change their first argument: the in-place family (``__iadd__``...,
    read off the module: every ``__iX__`` with an ``__X__``) and item assignment/deletion."""
    names = [n for n in dir(operator) if n.startswith("__i") and hasattr(operator, "__" + n[3:])]
    return frozenset([getattr(operator, n) for n in names] + [operator.setitem, operator.delitem])


def _packet(name: str) -> torch._ops.OpOverloadPacket | None:
    packet = getattr(torch.ops.aten, name, None)
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _overloads(op: _Op) -> list[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverload):
        return [op]
    return [getattr(op, o) for o in op.overloads()]


# Composite (CompositeImplicitAutograd) ATen ops whose every path ends in a kernel computing a new tensor, so
# their result never shares storage with an argument although the composite rule would assume it may:
_FRESH_COMPOSITES: dict[str, str] = {
    "aten::matmul": "dot / mv / mm / bmm of its (reshaped) operands; the product, reshaped or transposed, is returned",
    "aten::linear": "addmm, or matmul followed by an in-place add of the bias into that fresh product",
    # ATen's einsum (native/Linear.cpp) contracts operands pairwise while two or more are left; each step is
    # sumproduct_pair: mul when no dimension is summed, else bmm of the permuted operands. The result is that
    # product or a view of it. With one operand there is no pair: it returns the operand permuted, a diagonal
    # of it, or a sum ("ij->ji", "ii->i" are views), hence the condition in _FRESH_WHEN.
    "aten::einsum": "with two or more operands: mul or bmm of each pair, the last product (or a view of it) returned",
}


def _einsum_operand_count(node: fx.Node) -> int:
    """How many operands an einsum node passes (0 when the form is not one this can count: the sublist form,
    or operands arriving as one list-valued node, which may hold a single tensor)."""
    args, kwargs = node.args, node.kwargs
    if isinstance(node.target, _Op):  # aten::einsum(str equation, Tensor[] tensors, *, int[]? path)
        tensors = args[1] if len(args) > 1 else kwargs.get("tensors")
        return len(tensors) if isinstance(tensors, list | tuple) else 0
    if not args or not isinstance(args[0], str):  # torch.einsum(equation, *operands)
        return 0
    rest = args[1:]
    return len(rest[0]) if len(rest) == 1 and isinstance(rest[0], list | tuple) else len(rest)


# Fresh composites whose result is fresh only for some arguments: the condition on the node.
_FRESH_WHEN: dict[str, Callable[[fx.Node], bool]] = {
    "aten::einsum": lambda node: _einsum_operand_count(node) >= 2,
}


def fresh_composites() -> frozenset[str]:
    """Names of the composite ATen ops whose result is always fresh storage (tests check each one allocates)."""
    return frozenset(_FRESH_COMPOSITES)


def _may_alias_op(op: _Op) -> bool:
    """Whether an ATen op's result may share storage with an argument: its schema says so, or it is a
    composite (CompositeImplicitAutograd kernels such as ``dropout`` or ``type_as`` may return their input
    although their schemas declare no alias) not known to allocate (``matmul``: _FRESH_COMPOSITES)."""
    for overload in _overloads(op):
        if any(r.alias_info is not None and not r.alias_info.is_write for r in overload._schema.returns):
            return True  # a view (an ``out=`` / in-place overload returns the argument it writes: see _written)
        if overload._schema.name in _FRESH_COMPOSITES:
            continue
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeImplicitAutograd"):
                return True
        except RuntimeError:  # TorchScript-only overloads (``mul.left_t`` on lists) have no dispatcher entry
            continue
    return False


def _written_positions(op: _Op) -> set[int | str]:
    """Positions and names of the arguments an ATen op's schema marks as written (``out`` excluded)."""
    out: set[int | str] = set()
    for overload in _overloads(op):
        for i, arg in enumerate(overload._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write and arg.name != "out":
                out.update((i, arg.name) if not arg.kwarg_only else (arg.name,))
    return out


def _nodes_in(value: Any) -> Iterator[fx.Node]:
    """Every node inside an argument (lists, tuples, dicts, slices nested)."""
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _nodes_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _nodes_in(v)
    elif isinstance(value, slice):
        yield from _nodes_in((value.start, value.stop, value.step))


def _inplace_flag(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a Python function is asked to work in place (an ``inplace`` parameter, by keyword or position)."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = kwargs
    return "inplace" in bound and bound["inplace"] is not False


class StoredReach:
    """Fed the nodes of a graph in order, refuses writes to anything that may alias a stored tensor."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.reach: dict[fx.Node, str] = {}  # node → a stored tensor it may share storage with

    def add(self, node: fx.Node) -> None:
        """Record what ``node`` can reach; CheckpointError if it writes a stored tensor or holds a module."""
        if node.op == "get_attr":
            if isinstance(self._attr(str(node.target)), nn.Module):
                raise CheckpointError(f"get_attr {node.target!r} holds a module as a value; a graph may call "
                                      "modules (call_module) but not hold them (their methods change weights)")
            self.reach[node] = str(node.target)
            return
        if node.op in ("placeholder", "output"):
            return
        for written in self._written(node):
            if written in self.reach:
                raise CheckpointError(
                    f"writes in place to {written.name!r}, which may share storage with the stored tensor "
                    f"{self.reach[written]!r}: a checkpoint's graph may read its weights, never change them")
        reached = [self.reach[n] for n in node.all_input_nodes if n in self.reach]
        if reached and self._may_alias(node):
            self.reach[node] = reached[0]

    def _attr(self, target: str) -> Any:
        *parents, attr = target.split(".")
        owner = self.gm.get_submodule(".".join(parents))
        return owner._modules[attr] if attr in owner._modules else getattr(owner, attr)

    def _written(self, node: fx.Node) -> list[fx.Node]:
        """The nodes ``node`` may write: by ATen schema, the trailing-underscore convention, the operator
        in-place family, ``out=``, an ``inplace`` flag, or a module built with ``inplace``."""
        args, kwargs, target = node.args, dict(node.kwargs), node.target
        positions: set[int | str] = set()
        if node.op == "call_module":
            module = self.gm.get_submodule(str(target))
            positions |= {0} if getattr(module, "inplace", False) is not False else set()
        elif isinstance(target, _Op):
            positions |= _written_positions(target)
        else:
            name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
            if (name.endswith("_") and not name.endswith("__")) or target in _operator_writers() \
                    or (node.op == "call_function" and _inplace_flag(target, args, kwargs)):
                positions.add(0)
            packet = _packet(name)
            if packet is not None:
                positions |= _written_positions(packet)
        written = [v for p in positions for v in _nodes_in(args[p] if isinstance(p, int) and p < len(args)
                                                           else kwargs.get(str(p)))]
        return written + list(_nodes_in(kwargs.get("out")))

    def _may_alias(self, node: fx.Node) -> bool:
        """Whether the result may share storage with the node's inputs (True unless provably fresh)."""
        target = node.target
        if node.op == "call_module":
            return type(self.gm.get_submodule(str(target))) not in _FRESH_MODULES
        op: _Op | None = target if isinstance(target, _Op) else _packet(
            str(target) if node.op == "call_method" else canonical_function_name(target))
        if op is None:
            return True
        condition = _FRESH_WHEN.get(op._schema.name if isinstance(op, torch._ops.OpOverload)
                                    else op._qualified_op_name)
        return (condition is not None and not condition(node)) or _may_alias_op(op)
