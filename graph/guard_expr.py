"""torch.export's shape guards on arithmetic of input sizes, kept as plain data a checkpoint can hold.

torch.export records a guard for every branch the model's code took on a size: beyond ``size <= 64`` it
writes floor divisions, remainders, products, ``max``/``min`` and (in)equalities of such expressions
(EfficientNet: ``(side // 32) == 1``). Such a guard is parsed here -- never evaluated as Python -- into a
small program of lists that :func:`evaluate` interprets on the input shapes. Guards repeat sub-expressions
heavily (Swin's window padding ``(side // 4) + ((4 - (side // 4) % 4) % 4)`` appears dozens of times in one
5,000-character guard), so the program is the expression with each distinct sub-expression stored once, in
order: ``["let", ["floordiv", ["dim", 0, 3], ["int", 32]], ["cmp", "==", ["ref", 0], ["int", 1]]]`` (a step's
operands are sizes, integers or earlier steps; the last step is the guard's value). Its nesting is fixed and its
size linear in the distinct sub-expressions. Plain trees (``["cmp", "==", ["floordiv", ...], ["int", 1]]``,
checkpoints written before the sharing) are read too. Loading a checkpoint can hand it any data: anything outside
this grammar, too deep or too large, or naming a missing input, dimension or later step, raises ``ValueError``.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["parse_guard", "evaluate", "render", "dims_in", "Plan"]

_BINARY: dict[type[ast.operator], str] = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.FloorDiv: "floordiv",
                                          ast.Mod: "mod"}
_COMPARE: dict[type[ast.cmpop], str] = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
                                        ast.GtE: ">="}
_ARITH: dict[str, Callable[[int, int], int]] = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                                                "floordiv": operator.floordiv, "mod": operator.mod}
_CMP: dict[str, Callable[[int, int], bool]] = {"==": operator.eq, "!=": operator.ne, "<": operator.lt,
                                               "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//", "mod": "%"}
MAX_DEPTH = 24  # a plain tree's nesting (EfficientNet's deepest guard is 5 levels; a program's is always 3)
# lists in one guard (tree or program). Measured programs: 4-stage Swin 151, tiny 2-stage Swin 127, every other
# tiny model of tests/reach at most 46 (their trees: 3,767 / 1,911 / 53 nodes)
MAX_NODES = 512
MAX_INT = 2**62


def parse_guard(code: str, inputs: dict[str, int]) -> list[Any] | None:
    """The tree of a guard's Python text over ``L['name'].size()[d]`` of the named inputs, or None when the
    text is outside the grammar (the caller then fixes the dimensions it names instead)."""
    try:
        out = _shared(_from_ast(ast.parse(code.strip(), mode="eval").body, inputs))
        validate(out, len(inputs))
        return out
    except (SyntaxError, ValueError, RecursionError):
        return None


def _shared(tree: list[Any]) -> list[Any]:
    """The ``let`` program of a parsed tree: every distinct operation once, operands before their users."""
    steps: list[list[Any]] = []
    seen: dict[str, int] = {}

    def operand(node: list[Any]) -> list[Any]:
        if node[0] in ("int", "dim"):
            return node
        step = [node[0], *[a if isinstance(a, str) else operand(a) for a in node[1:]]]
        key = repr(step)
        if key not in seen:
            seen[key] = len(steps)
            steps.append(step)
        return ["ref", seen[key]]

    operand(tree)
    return ["let", *steps] if steps else tree


def _from_ast(node: ast.expr, inputs: dict[str, int]) -> list[Any]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return ["int", node.value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        operand = _from_ast(node.operand, inputs)  # torch writes (-1)*x: a negative constant stays one leaf
        return ["int", -operand[1]] if operand[0] == "int" else ["sub", ["int", 0], operand]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ["not", _from_ast(node.operand, inputs)]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return [_BINARY[type(node.op)], _from_ast(node.left, inputs), _from_ast(node.right, inputs)]
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        return ["cmp", _COMPARE[type(node.ops[0])], _from_ast(node.left, inputs),
                _from_ast(node.comparators[0], inputs)]
    if isinstance(node, ast.BoolOp):
        return ["and" if isinstance(node.op, ast.And) else "or", *[_from_ast(v, inputs) for v in node.values]]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min") \
            and len(node.args) >= 2 and not node.keywords:
        return [node.func.id, *[_from_ast(a, inputs) for a in node.args]]
    dim = _size_ref(node, inputs)
    if dim is None:
        raise ValueError(f"not a size expression: {ast.dump(node)[:80]}")
    return ["dim", *dim]


def _size_ref(node: ast.expr, inputs: dict[str, int]) -> tuple[int, int] | None:
    """(input index, dim) of ``L['name'].size()[d]``."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and type(node.slice.value) is int and isinstance(node.value, ast.Call)
            and not node.value.args and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "size" and isinstance(node.value.func.value, ast.Subscript)):
        return None
    source = node.value.func.value
    if isinstance(source.value, ast.Name) and source.value.id == "L" and isinstance(source.slice, ast.Constant) \
            and source.slice.value in inputs:
        return inputs[source.slice.value], node.slice.value
    return None


def validate(tree: Any, n_inputs: int, depth: int = 0, budget: list[int] | None = None) -> None:
    """ValueError unless ``tree`` is a well-formed guard over ``n_inputs`` inputs, within the size limits."""
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise ValueError(f"shape guard expression deeper than {MAX_DEPTH} or over {MAX_NODES} nodes")
    if not isinstance(tree, list | tuple) or not tree or not isinstance(tree[0], str):
        raise ValueError(f"shape guard expression node {str(tree)[:60]!r} is not [op, ...]")
    op, args = tree[0], tree[1:]
    if op == "let" and depth == 0:
        _validate_program(args, n_inputs, budget)
    elif op == "int":
        if len(args) != 1 or type(args[0]) is not int or abs(args[0]) > MAX_INT:
            raise ValueError(f"shape guard constant {str(args)[:60]} is not a small integer")
    elif op == "dim":
        if len(args) != 2 or any(type(a) is not int for a in args) or not 0 <= args[0] < n_inputs \
                or not 0 <= args[1] < 64:
            raise ValueError(f"shape guard names input/dimension {str(args)[:60]}, which the graph does not have")
    elif op == "cmp":
        if len(args) != 3 or args[0] not in _CMP:
            raise ValueError(f"shape guard comparison {str(args)[:60]} is malformed")
        validate(args[1], n_inputs, depth + 1, budget)
        validate(args[2], n_inputs, depth + 1, budget)
    elif op in _ARITH or op in ("max", "min", "and", "or", "not"):
        arity_ok = len(args) == 2 if op in _ARITH else len(args) == 1 if op == "not" else len(args) >= 2
        if not arity_ok:
            raise ValueError(f"shape guard operation {op!r} has {len(args)} operands")
        for a in args:
            validate(a, n_inputs, depth + 1, budget)
    else:
        raise ValueError(f"shape guard operation {str(op)[:40]!r} is not allowed")


def _validate_program(steps: Sequence[Any], n_inputs: int, budget: list[int]) -> None:
    """ValueError unless each step is one operation whose operands are leaves or earlier steps."""
    if not steps or len(steps) > MAX_NODES:
        raise ValueError(f"shape guard program has {len(steps)} steps (1 to {MAX_NODES} allowed)")
    for k, step in enumerate(steps):
        if not isinstance(step, list | tuple) or not step or step[0] in ("int", "dim", "ref", "let"):
            raise ValueError(f"shape guard step {str(step)[:60]!r} is not an operation")
        for a in step[2:] if step[0] == "cmp" else step[1:]:
            if _is_ref(a):
                if type(a[1]) is not int or not 0 <= a[1] < k:
                    raise ValueError(f"shape guard step {k} refers to {str(a[1])[:20]}, not an earlier step")
            elif not (isinstance(a, list | tuple) and a and a[0] in ("int", "dim")):
                raise ValueError(f"shape guard step {k} operand {str(a)[:60]!r} is not a size, integer or step")
        # the operation itself (operator, arity, leaves), with its step operands read as integers
        validate([step[0], *[["int", 0] if _is_ref(a) else a for a in step[1:]]], n_inputs, 1, budget)


def _is_ref(a: Any) -> bool:
    return isinstance(a, list | tuple) and len(a) == 2 and a[0] == "ref"


def evaluate(tree: Sequence[Any], shapes: Sequence[Sequence[int] | None]) -> Any:
    """The value of a validated tree or program at ``shapes`` (each input's shape; None for a non-tensor
    input). A program is run step by step, each step once, without recursion."""
    op, args = tree[0], tree[1:]
    if op == "let":
        values: list[Any] = []
        for step in args:
            values.append(_apply(step[0], [values[a[1]] if _is_ref(a) else a if isinstance(a, str) else
                                           evaluate(a, shapes) for a in step[1:]], step))
        return values[-1]
    if op == "int":
        return args[0]
    if op == "dim":
        shape = shapes[args[0]]
        if shape is None or args[1] >= len(shape):
            raise ValueError(f"shape guard reads dimension {args[1]} of input {args[0]}, which it does not have")
        return shape[args[1]]
    return _apply(op, [a if isinstance(a, str) else evaluate(a, shapes) for a in args], tree)


def _apply(op: str, values: list[Any], tree: Sequence[Any]) -> Any:
    """One operation on its operands' values (``cmp``: the operator, then both sides)."""
    if op == "cmp":
        return _CMP[values[0]](values[1], values[2])
    if op in _ARITH:
        if op in ("floordiv", "mod") and values[1] == 0:
            raise ValueError(f"shape guard divides by zero: {str(tree)[:80]}")
        return _ARITH[op](values[0], values[1])
    if op == "not":
        return not values[0]
    if op == "and":
        return all(values)
    if op == "or":
        return any(values)
    return max(values) if op == "max" else min(values)


_UNSET = object()
_NARY: dict[str, Callable[..., Any]] = {"and": lambda *v: all(v), "or": lambda *v: any(v), "max": max, "min": min,
                                        "not": operator.not_}


class Plan:
    """Validated trees or programs compiled once into one table of distinct operations (shared across the
    programs: Swin's 255 guards repeat the same window padding), so a call evaluates each distinct operation
    at most once, in each program's own order (the same values and the same first error as :func:`evaluate`).
    Build it only from validated trees: it does not check them."""

    def __init__(self, trees: Sequence[Sequence[Any]]) -> None:
        self.template: list[Any] = []  # a slot per distinct leaf or operation: constants filled, others unset
        self.steps: list[tuple[Callable[..., Any] | None, tuple[int, ...], Any]] = []  # (fn, operands, source)
        self.orders: list[list[int]] = []  # per tree: the slots to compute, operands first; the last is its value
        self._slots: dict[tuple[Any, ...], int] = {}
        self.finals: list[int] = []  # per tree: the slot of its value
        for tree in trees:
            order: list[int] = []
            if tree[0] == "let":
                local: list[int] = []
                for step in tree[1:]:
                    operands = step[2:] if step[0] == "cmp" else step[1:]
                    local.append(self._op(step, [local[a[1]] if _is_ref(a) else self._leaf_or_op(a, order)
                                                 for a in operands], order))
                self.finals.append(local[-1])
            else:
                self.finals.append(self._leaf_or_op(tree, order))
            self.orders.append(order)

    def _slot(self, key: tuple[Any, ...], value: Any, step: tuple[Callable[..., Any] | None, tuple[int, ...], Any],
              order: list[int]) -> int:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self.template)
            self.template.append(value)
            self.steps.append(step)
        if value is _UNSET and slot not in order:
            order.append(slot)
        return slot

    def _leaf_or_op(self, tree: Sequence[Any], order: list[int]) -> int:
        if tree[0] == "int":
            return self._slot(("int", tree[1]), tree[1], (None, (), tree), order)
        if tree[0] == "dim":
            return self._slot(("dim", tree[1], tree[2]), _UNSET, (None, (tree[1], tree[2]), tree), order)
        operands = tree[2:] if tree[0] == "cmp" else tree[1:]
        return self._op(tree, [self._leaf_or_op(a, order) for a in operands], order)

    def _op(self, tree: Sequence[Any], operands: list[int], order: list[int]) -> int:
        op = tree[0]
        fn = _CMP[tree[1]] if op == "cmp" else _ARITH.get(op) or _NARY[op]
        key = (op, tree[1] if op == "cmp" else None, *operands)
        return self._slot(key, _UNSET, (fn, tuple(operands), tree), order)

    def run(self, k: int, shapes: Sequence[Sequence[int] | None], values: list[Any]) -> Any:
        """The value of tree ``k`` at ``shapes``; ``values`` (a copy of ``template``, one per call) keeps
        every operation computed so far in this call, so the other trees reuse it."""
        steps = self.steps
        slot = -1
        try:
            for slot in self.orders[k]:
                if values[slot] is _UNSET:
                    fn, operands, _ = steps[slot]
                    if fn is None:
                        shape = shapes[operands[0]]
                        if shape is None or operands[1] >= len(shape):
                            raise ValueError(f"shape guard reads dimension {operands[1]} of input {operands[0]}, "
                                             "which it does not have")
                        values[slot] = shape[operands[1]]
                    else:
                        values[slot] = fn(*[values[o] for o in operands])
        except ZeroDivisionError:
            raise ValueError(f"shape guard divides by zero: {str(steps[slot][2])[:80]}") from None
        return values[self.finals[k]]


RENDER_CHARS = 300  # a rendered step longer than this is cut (a shared guard expands to thousands of chars)


def render(tree: Sequence[Any], names: Sequence[str], steps: Sequence[str] = ()) -> str:
    """The guard as readable text (``pixel_values.shape[2] // 32 == 1``) for error messages; a program's
    steps are expanded in place, each cut to ``RENDER_CHARS`` so the text stays short."""
    op, args = tree[0], tree[1:]
    if op == "let":
        done: list[str] = []
        for step in args:
            text = render(step, names, done)
            done.append(text if len(text) <= RENDER_CHARS else text[:RENDER_CHARS] + " ...")
        return done[-1]
    if op == "ref":
        return steps[args[0]]
    if op == "int":
        return str(args[0])
    if op == "dim":
        return f"{names[args[0]]}.shape[{args[1]}]"
    if op == "cmp":
        return f"{render(args[1], names, steps)} {args[0]} {render(args[2], names, steps)}"
    if op in _SYMBOL:
        return f"({render(args[0], names, steps)} {_SYMBOL[op]} {render(args[1], names, steps)})"
    if op == "not":
        return f"not {render(args[0], names, steps)}"
    if op in ("and", "or"):
        return f" {op} ".join(f"({render(a, names, steps)})" for a in args)
    return f"{op}({', '.join(render(a, names, steps) for a in args)})"


def dims_in(tree: Sequence[Any]) -> list[tuple[int, int]]:
    """The (input, dim) pairs a tree reads, in order of first appearance."""
    if tree[0] == "int":
        return []
    if tree[0] == "dim":
        return [(tree[1], tree[2])]
    out: list[tuple[int, int]] = []
    for a in tree[1:]:
        if isinstance(a, list | tuple):
            out += [d for d in dims_in(a) if d not in out]
    return out
