"""Shape guards of an export-captured graph: the input shapes torch.export proved the graph valid for,
kept as one cheap runtime check (a node right after the placeholders) that survives copies and checkpoints.

torch.export specialises what the model's Python code depends on (a loop over the sequence is unrolled for
the example's length) and proves ranges for the rest (``seq <= max_position_embeddings``). Its own
``_guards_fn`` is Python generated from strings, which a checkpoint cannot hold; normalisation replaces it
by a call to :func:`check_input_shapes` with the constraints as plain data, built here from the exported
program's placeholders, range constraints and (simple) tracer guards. A dimension a dynamic capture meant
dynamic but torch.export fixed keeps the reason graph/static_dims found (the code line that fixed it). A
violated constraint raises :class:`ShapeGuardError` naming the input, the dimension, the allowed values,
that reason and the remedy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from . import targets
from .guard_expr import Plan, dims_in, parse_guard, render, validate
from .static_dims import specialisation_reasons

__all__ = ["ShapeGuardError", "check_input_shapes", "validate_checks", "guard_spec", "insert_guard",
           "GUARD_NODE"]

GUARD_NODE = "fxforge_shape_guard"
_ALIAS_OPS = {"slice", "alias", "detach", "clone", "contiguous"}
_WHY_CHARS = 400  # an expression guard's text kept as its reason (Swin's run to 5,000 characters)
_ITEM_REF = re.compile(r"L\['(\w+)'\]\[(\d+)\]")
_SIZE_REF = re.compile(r"L\['(\w+)'\]\.size\(\)\[(\d+)\]")
_GUARD = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\] (==|<=|>=|<|>) (?:(-?\d+)|L\['(\w+)'\]\.size\(\)\[(\d+)\])$")


class ShapeGuardError(ValueError):
    """An input's shape is outside what the captured graph was specialised for."""


def _fail(names: Sequence[str], index: int, dim: int, actual: int, allowed: str, why: str) -> None:
    raise ShapeGuardError(
        f"input {names[index]!r} dimension {dim} is {actual}, but this graph only accepts {allowed}: {why}. "
        "Pass inputs inside that range, or re-capture the model (ForgeGraph(model, example_inputs=..., "
        "dynamic=True)) with an example of the size you need")


_KINDS = ("rank", "eq", "range", "same", "expr")
_PLANS: dict[int, tuple[Any, Plan]] = {}  # id(checks) -> (checks, its plan): a graph's checks are one constant
_MAX_PLANS = 256


def _frozen(value: Any) -> bool:
    """Whether ``value`` is tuples all the way down (so a plan built from it stays true to it)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, tuple):
            stack.extend(v)
        elif not isinstance(v, int | str | None):
            return False
    return True


def _plan(checks: Sequence[Sequence[Any]]) -> Plan:
    """The compiled expression checks of ``checks``, built once per checks object. The generated forward
    passes the same constant tuple on every call; anything mutable is compiled afresh each call."""
    entry = _PLANS.get(id(checks))
    if entry is not None and entry[0] is checks:
        return entry[1]
    plan = Plan([value for _, _, kind, value, _ in checks if kind == "expr"])
    if _frozen(checks):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[id(checks)] = (checks, plan)  # holding checks keeps its id from being reused
    return plan


@torch.fx.node.has_side_effect
def check_input_shapes(*inputs: Any, names: Sequence[str], checks: Sequence[Sequence[Any]]) -> None:
    """Raise ShapeGuardError unless every check holds. A check is ``(input, dim, kind, value, why)``:
    kind ``rank`` (value: ndim), ``eq`` (value: size), ``range`` (value: (lo, hi or None)), ``same``
    (value: (other input, other dim)), ``expr`` (value: a graph/guard_expr tree over the input sizes that must
    hold; index and dim name the first size it reads). Every check is evaluated on every call; the checks are
    trusted (capture builds them; a checkpoint's are validated by :func:`validate_checks` when it loads)."""
    plan: Plan | None = None
    values: list[Any] = []
    shapes: list[tuple[int, ...] | None] = []
    k = 0
    for index, dim, kind, value, why in checks:
        if kind == "expr":
            if plan is None:
                plan = _plan(checks)
                values = plan.template.copy()
                shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs]
            k += 1
            if not plan.run(k - 1, shapes, values):
                shape = shapes[index] if 0 <= index < len(shapes) else None
                _fail(names, index, dim, shape[dim] if shape is not None and 0 <= dim < len(shape) else -1,
                      f"shapes where {render(value, names)}", why)
            continue
        x = inputs[index]
        if not isinstance(x, torch.Tensor):
            continue
        if kind == "rank":
            if x.dim() != value:
                raise ShapeGuardError(f"input {names[index]!r} has {x.dim()} dimensions, but this graph was captured "
                                      f"for {value} ({why}); pass a {value}-d tensor")
            continue
        size = x.shape[dim]
        if kind == "eq" and size != value:
            _fail(names, index, dim, size, f"exactly {value}", why)
        elif kind == "range" and (size < value[0] or (value[1] is not None and size > value[1])):
            hi = "inf" if value[1] is None else value[1]
            _fail(names, index, dim, size, f"sizes in [{value[0]}, {hi}]", why)
        elif kind == "same":
            other = inputs[value[0]]
            if isinstance(other, torch.Tensor) and other.dim() > value[1] and size != other.shape[value[1]]:
                _fail(names, index, dim, size, f"the size of {names[value[0]]!r} dimension {value[1]} "
                      f"({other.shape[value[1]]})", why)


def validate_checks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """CheckpointError unless a loaded guard call's ``names`` and ``checks`` are what capture writes: each check
    well-formed, naming inputs and dimensions the call has (an expression within graph/guard_expr's limits and
    the ranks the checks record), so the per-call check never has to re-validate."""
    n = len(args)
    names, checks = kwargs.get("names"), kwargs.get("checks")
    if set(kwargs) != {"names", "checks"} or not isinstance(names, list | tuple) or len(names) != n \
            or not all(isinstance(a, str) for a in names) or not isinstance(checks, list | tuple):
        raise targets.CheckpointError("shape guard check call needs names (one per input) and checks")
    ranks = {c[0]: c[3] for c in checks if isinstance(c, list | tuple) and len(c) == 5 and c[2] == "rank"}

    def small(v: Any, bound: int) -> bool:
        return type(v) is int and 0 <= v < bound

    for check in checks:
        ok = isinstance(check, list | tuple) and len(check) == 5
        if ok:
            index, dim, kind, value, why = check
            ok = small(index, n) and small(dim, 64) and kind in _KINDS and isinstance(why, str)
            if ok and kind in ("rank", "eq"):
                ok = type(value) is int and value >= 0
            elif ok and kind == "range":
                ok = isinstance(value, list | tuple) and len(value) == 2 and type(value[0]) is int \
                    and (value[1] is None or type(value[1]) is int)
            elif ok and kind == "same":
                ok = isinstance(value, list | tuple) and len(value) == 2 and small(value[0], n) \
                    and small(value[1], 64)
            elif ok and kind == "expr":
                try:
                    validate(value, n)
                except (ValueError, RecursionError) as exc:
                    raise targets.CheckpointError(str(exc)) from None
                for i, d in dims_in(value):
                    if i in ranks and not (type(ranks[i]) is int and d < ranks[i]):
                        raise targets.CheckpointError(f"shape guard reads dimension {d} of input {names[i]!r}, "
                                                      f"which has {ranks[i]}")
        if not ok:
            raise targets.CheckpointError(f"shape guard check {str(check)[:120]} is malformed")


targets.register_function(check_input_shapes, name="fxforge.check_input_shapes")
targets.register_call_check("fxforge.check_input_shapes", validate_checks)


def _unrolled_steps(placeholder: fx.Node, dim: int) -> int:
    """How many constant-index selects along ``dim`` read this input: a Python loop unrolled by export."""
    seen: set[int] = set()
    stack = [placeholder]
    while stack:
        node = stack.pop()
        for user in node.users:
            target = getattr(user.target, "__name__", str(user.target)).split(".")[0]
            if target in _ALIAS_OPS and user.args and user.args[0] is node and \
                    not (target == "slice" and len(user.args) > 1 and user.args[1] == dim):
                stack.append(user)
            elif target == "select" and len(user.args) > 2 and user.args[1] == dim and isinstance(user.args[2], int):
                seen.add(user.args[2])
            elif target == "unbind" and (user.args[1] if len(user.args) > 1 else 0) == dim:
                return int(placeholder.meta["val"].shape[dim])
    return len(seen)


def _range(vr: Any) -> tuple[int, int | None]:
    lo, hi = vr.lower, vr.upper
    lo_i = int(lo) if lo.is_finite else 0
    hi_i = int(hi) if hi.is_finite and float(hi) < math.inf else None
    return lo_i, hi_i


def _implied(checks: list[tuple[Any, ...]], i: int, d: int, op: str, v: int) -> bool:
    """Whether a tracer guard ``size op v`` on input i, dim d already follows from ``checks``."""
    for ci, cd, kind, value, _ in checks:
        if (ci, cd) != (i, d):
            continue
        lo, hi = (value, value) if kind == "eq" else value if kind == "range" else (None, None)
        if lo is None:
            continue
        if (op == "==" and lo == hi == v) or (op == "<=" and hi is not None and hi <= v) or \
                (op == "<" and hi is not None and hi < v) or (op == ">=" and lo >= v) or (op == ">" and lo > v):
            return True
    return False


def _flat_refs(code: str, index: dict[str, int]) -> str:
    """A guard's references to an element of a tuple input (``L['cache'][0]``, a ``*cache`` parameter) renamed to
    the placeholder torch.export flattened it into (``L['cache_0']``), so the guard is kept like any other."""
    while True:
        new = _ITEM_REF.sub(lambda m: f"L['{m[1]}_{m[2]}']" if f"{m[1]}_{m[2]}" in index else m[0], code)
        if new == code:
            return code
        code = new


def guard_spec(gm: fx.GraphModule, range_constraints: dict[Any, Any], guards_code: Sequence[str],
               dynamic: bool) -> tuple[tuple[str, ...], list[tuple[Any, ...]], list[str]]:
    """(input names, checks, notes) for the export-captured ``gm``: specialisations, proven ranges, equal
    dimensions, and the tracer's simple size guards; ``notes`` list guards that could not be kept."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = tuple(n.name for n in placeholders)
    index = {n: i for i, n in enumerate(names)}
    checks: list[tuple[Any, ...]] = []
    notes: list[str] = []
    sources: dict[Any, tuple[int, int]] = {}
    reasons = specialisation_reasons(placeholders) if dynamic else {}
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        checks.append((i, 0, "rank", val.dim(), "its rank is part of the captured program"))
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_number:  # specialised symbol
                size = int(size.node.expr)
            if isinstance(size, int):
                steps = _unrolled_steps(node, d)
                found = reasons.get((names[i], d))
                if steps > 1:
                    why = f"capture specialised this dimension to {size}: a Python loop over it was unrolled " \
                          f"into {steps} steps, so other sizes would silently run {steps} steps" + \
                          (f" ({found})" if found else "")
                elif dynamic:
                    why = found or f"torch.export specialised {names[i]} dim {d} to the example's {size}: the " \
                                   "model's code depends on its value"
                else:
                    why = f"the graph was captured with dynamic=False for the example's size {size}"
                checks.append((i, d, "eq", size, why))
                continue
            expr = size.node.expr
            if expr in sources:
                checks.append((i, d, "same", sources[expr], "capture proved these dimensions equal"))
            elif expr in range_constraints:
                sources[expr] = (i, d)
                lo, hi = _range(range_constraints[expr])
                if lo > 2 or hi is not None:
                    checks.append((i, d, "range", (lo, hi), "the range torch.export proved the graph valid for"))
            else:
                notes.append(f"shape guard: {names[i]} dimension {d} = {expr} is a derived size; not checked")
    for code in guards_code:
        code = _flat_refs(code, index)
        m = _GUARD.match(code.strip())
        if m is None or m.group(1) not in index or (m.group(5) is not None and m.group(5) not in index):
            _keep_expression(code, placeholders, index, checks, notes)
            continue
        i, d, op = index[m.group(1)], int(m.group(2)), m.group(3)
        why = f"torch.export guard {code}"
        if m.group(4) is not None:
            v = int(m.group(4))
            if _implied(checks, i, d, op, v):
                continue
            if op == "==":
                checks.append((i, d, "eq", v, why))
            else:
                checks.append((i, d, "range", {"<=": (0, v), "<": (0, v - 1), ">=": (v, None), ">": (v + 1, None)}[op],
                               why))
        elif op == "==":
            other = (index[m.group(5)], int(m.group(6)))
            known = {(c[0], c[1], *c[3]) for c in checks if c[2] == "same"}
            if (i, d, *other) not in known and (*other, i, d) not in known:
                checks.append((i, d, "same", other, why))
        else:
            notes.append(f"shape guard {code!r} from torch.export is not kept (an inequality between inputs)")
    return names, checks, notes


def _keep_expression(code: str, placeholders: list[fx.Node], index: dict[str, int], checks: list[tuple[Any, ...]],
                     notes: list[str]) -> None:
    """Keep a guard on arithmetic of sizes (``side // 32 == 1``) as an ``expr`` check; one outside
    graph/guard_expr's grammar fixes every dimension it names to the example's size instead (refused
    loudly rather than unchecked)."""
    why = f"torch.export guard {code}"
    tree = parse_guard(code, index)
    if tree is not None and any(c[2] == "expr" and c[3] == tree for c in checks):
        return  # torch.export repeats some guards word for word
    if tree is not None and dims_in(tree):
        i, d = dims_in(tree)[0]
        short = why if len(why) <= _WHY_CHARS else why[:_WHY_CHARS] + " ..."  # the check renders the rest
        checks.append((i, d, "expr", tree, short))
        return
    named = [(index[n], int(d)) for n, d in _SIZE_REF.findall(code) if n in index]
    if not named:
        notes.append(f"shape guard {code!r} from torch.export is not kept (it reads no input size)")
        return
    for i, d in dict.fromkeys(named):
        val = placeholders[i].meta.get("val")
        size = val.shape[d] if isinstance(val, torch.Tensor) and d < val.dim() else None
        hint = getattr(getattr(size, "node", None), "hint", size)
        if isinstance(hint, int) and not _implied(checks, i, d, "==", hint):
            checks.append((i, d, "eq", hint, f"{why} could not be kept as a check, so this dimension is fixed to "
                                              f"the example's {hint}"))
    fixed = ", ".join(f"{placeholders[i].name} dim {d}" for i, d in dict.fromkeys(named))
    notes.append(f"shape guard {code!r} from torch.export fixes {fixed} to the example's size (not expressible as "
                 "a check)")


def insert_guard(gm: fx.GraphModule, names: tuple[str, ...], checks: list[tuple[Any, ...]]) -> fx.Node | None:
    """Insert the guard call after the placeholders (nothing when there is nothing to check)."""
    if not any(c[2] != "rank" for c in checks):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        return gm.graph.create_node("call_function", check_input_shapes, tuple(placeholders),
                                    {"names": names, "checks": tuple(tuple(_freeze(v) for v in c) for c in checks)},
                                    name=GUARD_NODE)


def _freeze(value: Any) -> Any:
    """Lists as tuples, all the way down: the generated code then passes one constant, built once."""
    return tuple(_freeze(v) for v in value) if isinstance(value, list | tuple) else value
