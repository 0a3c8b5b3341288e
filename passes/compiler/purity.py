"""Which nodes are pure (same inputs → same value, no side effects) and which depend only on parameters.

Shared by the compiler passes (CSE, DCE, hoisting, folding). Purity is decided conservatively: ATen
ops by their schema (mutating or ``nondeterministic_seeded`` → impure), Python-level torch functions
and tensor methods through the ATen op of the same name, modules by an allowlist of layers that are
deterministic in both train and eval mode (never dropout or batch norm). Unknown calls are impure.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.ir import canonical_function_name

aten = torch.ops.aten

# Layers whose output depends only on their input and parameters, in train and eval mode alike.
PURE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.Identity, nn.ReLU, nn.GELU,
    nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LogSoftmax,
)
_PURE_BUILTINS = {operator.getitem, getattr, operator.add, operator.sub, operator.mul, operator.truediv,
                  operator.floordiv, operator.mod, operator.pow, operator.neg, operator.matmul, operator.eq,
                  operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
                  operator.invert}
_IN_PLACE_BUILTINS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem,
                      operator.imatmul, operator.iand, operator.ior}
# Factories whose output is uninitialised memory: two of them are not "the same value".
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_RANDOM_NAMES = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "rrelu", "poisson")


def _packet(name: str) -> torch._ops.OpOverloadPacket | None:
    packet = getattr(aten, name, None)
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _overload_pure(op: torch._ops.OpOverload) -> bool:
    return (not op._schema.is_mutable and torch.Tag.nondeterministic_seeded not in op.tags
            and torch.Tag.inplace not in op.tags)


def _name_pure(name: str) -> bool:
    """A Python-level function/method is pure when its name is a functional ATen op that is never random."""
    if name.endswith("_") and not name.startswith("_") or name in _UNINITIALISED:
        return False
    if any(word in name for word in _RANDOM_NAMES):
        return False
    packet = _packet(name)
    if packet is None:
        return name in ("size", "dim", "contiguous", "type_as")
    overloads = [getattr(packet, o) for o in packet.overloads()]
    functional = [o for o in overloads if not o._schema.is_mutable]
    return bool(functional) and not any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads)


def _random_kwargs(node: fx.Node) -> bool:
    """A call that asks for randomness through its arguments (dropout_p > 0, train=True)."""
    for key in ("dropout_p", "p"):
        value = node.kwargs.get(key)
        if isinstance(value, int | float) and value > 0:
            return True
    name = str(node.target) if node.op == "call_method" else canonical_function_name(node.target)
    if "scaled_dot_product" in name and len(node.args) > 4 and node.args[4] != 0:
        return True  # positional dropout_p
    return node.kwargs.get("train") is True or node.kwargs.get("training") is True


def is_pure(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` computes a value from its inputs only, without side effects or randomness."""
    if node.op == "get_attr":
        return True
    if node.op in ("placeholder", "output"):
        return False
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return type(module) in PURE_MODULES
    if node.op == "call_method":
        return _name_pure(str(node.target)) and not _random_kwargs(node)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::", 1)[1]
        return _overload_pure(target) and name not in _UNINITIALISED and not _random_kwargs(node)
    if target in _IN_PLACE_BUILTINS:
        return False
    if target in _PURE_BUILTINS:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket | torch._ops.HigherOrderOperator):
        return False
    return _name_pure(canonical_function_name(target)) and not _random_kwargs(node)


def _writes(node: fx.Node) -> list[fx.Node]:
    """Inputs ``node`` may write to (in-place ops, out= arguments, setitem)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        schema, written = node.target._schema, []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                values = value if isinstance(value, list | tuple) else [value]
                written += [v for v in values if isinstance(v, fx.Node)]
        return written
    name = str(node.target) if node.op == "call_method" else (
        canonical_function_name(node.target) if node.op == "call_function" else "")
    in_place = node.op == "call_function" and node.target in _IN_PLACE_BUILTINS
    if in_place or (name.endswith("_") and not name.startswith("_")) or "out" in node.kwargs:
        return [a for a in node.all_input_nodes][:1] + [v for v in [node.kwargs.get("out")] if isinstance(v, fx.Node)]
    return []


def mutated_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value may be written in place by some op, directly or through a view (conservatively:
    through any chain of calls, since a view may share the storage; the result of an in-place or out= call
    is the value it wrote, so only that one is followed)."""
    out: set[fx.Node] = set()
    stack = [w for n in graph.nodes for w in _writes(n)]
    while stack:
        node = stack.pop()
        if node in out:
            continue
        out.add(node)
        if node.op.startswith("call"):
            stack.extend(_writes(node) or node.all_input_nodes)
    return out


def _freeze(value: Any) -> Any:
    """A hashable, type-exact key of a node argument (1, 1.0 and True differ; -0.0 and 0.0 differ)."""
    if isinstance(value, fx.Node):
        return ("node", value)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _freeze(value.start), _freeze(value.stop), _freeze(value.step))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, torch.Tensor):
        raise TypeError("tensor constants are not compared")
    hash(value)
    return (type(value).__name__, value)


def cse_key(node: fx.Node) -> Any | None:
    """What makes two pure nodes compute the same value; None when the node cannot be keyed."""
    try:
        return (node.op, node.target, _freeze(tuple(node.args)), _freeze(dict(node.kwargs)))
    except TypeError:
        return None


def parameter_only_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Call nodes (in graph order) whose value depends only on parameters, buffers and constants:
    pure, with every input a get_attr or another such node (factories like ``eye`` included)."""
    mutated = mutated_nodes(gm.graph)
    const: set[fx.Node] = set()
    out: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node not in mutated:
            const.add(node)
        elif (node.op.startswith("call") and node not in mutated and is_pure(node, gm)
              and all(i in const for i in node.all_input_nodes)):
            const.add(node)
            out.append(node)
    return out
