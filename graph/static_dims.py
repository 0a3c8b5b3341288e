"""Which input dimensions of an export-captured graph stayed static, and why.

A dynamic capture asks torch.export for every input dimension dynamic, but torch.export fixes a dimension
whose value the model's code needs (Funnel builds its relative positions from ``list(range(seq_len))``;
a Python loop over the sequence is unrolled) or that meets a fixed size (a layer's weight in a matmul, a
broadcast against a fixed dimension). :func:`specialisation_reasons` finds, in torch's shape environment,
the guard that fixed each such dimension and turns its source location into a reason; the shape guard
keeps the reason (graph/guards), so :func:`input_dims` reads dynamic and static dimensions back from any
graph, including reloaded checkpoints (older ones just carry older reason texts).
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

__all__ = ["InputDims", "StaticDim", "input_dims", "specialisation_reasons"]

_SOURCE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")
_TORCH_DIR = str(Path(torch.__file__).parent)
_MATMUL = ("mm", "matmul", "linear", "addmm", "bmm", "baddbmm", "conv", "einsum")
_BROADCAST = ("infer_size", "broadcast", "expand")


def _shape_env(placeholders: list[fx.Node]) -> Any:
    """torch's ShapeEnv the export ran under (kept by the fake values of the placeholders), or None."""
    for node in placeholders:
        env = getattr(getattr(node.meta.get("val"), "fake_mode", None), "shape_env", None)
        if env is not None:
            return env
    return None


def _frame(sloc: Any) -> Any:
    """The FrameSummary a torch SLoc points at (None when it holds only text)."""
    loc = getattr(sloc, "framework_loc", None)
    return loc if hasattr(loc, "filename") and hasattr(loc, "lineno") else None


def _cause(sloc: Any, expr: Any) -> str:
    """Why the guard at ``sloc`` fixed a size: the model's own code, a fixed-size operand, or the raw guard."""
    frame = _frame(sloc)
    if frame is None:
        user = getattr(sloc, "maybe_user_loc", None)
        return f"torch guard {expr}" + (f" ({user})" if user else "")
    short = "/".join(Path(frame.filename).parts[-2:])
    where = f"{short}:{frame.lineno} in {frame.name}"
    if not str(frame.filename).startswith(_TORCH_DIR):
        src = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        return "the model's code needs its value as a Python int (a shape computation, a loop or a branch) " \
               f"at {where}" + (f" `{src}`" if src else "")
    user = getattr(sloc, "maybe_user_loc", None)
    user_part = f", reached from {user}" if user else ""
    if any(k in frame.name for k in _BROADCAST):
        return f"it is broadcast against a dimension that is already fixed (torch's {frame.name}{user_part})"
    if any(k in frame.name for k in _MATMUL):
        return f"it meets a fixed-size operand such as a layer's weight (torch's {frame.name}{user_part})"
    return f"torch guard {expr} at {where}{user_part}"


def specialisation_reasons(placeholders: list[fx.Node]) -> dict[tuple[str, int], str]:
    """``(input name, dim) -> reason`` for every input dimension torch.export fixed to one value, from the
    guard (or range refinement) that fixed it; empty when the shape environment is not reachable."""
    env = _shape_env(placeholders)
    if env is None:
        return {}
    names = {n.name for n in placeholders}
    reasons: dict[tuple[str, int], str] = {}
    for symbol, sources in getattr(env, "var_to_sources", {}).items():
        value = getattr(env, "replacements", {}).get(symbol)
        if value is None or not getattr(value, "is_number", False):
            continue
        for source in sources:
            m = _SOURCE.match(source.name)
            if m is None or m.group(1) not in names:
                continue
            # the guard pinning this symbol alone to a number (not one relating it to another symbol)
            guard = next((g for g in env.guards if g.expr.is_Equality and g.expr.free_symbols == {symbol}), None)
            ranges = getattr(env, "var_to_range_sloc", {}).get(symbol)
            if guard is not None:
                cause = _cause(guard.sloc, guard.expr)
            else:
                cause = _cause(getattr(ranges, "lower", None), f"{symbol} == {value}")
            reasons[(m.group(1), int(m.group(2)))] = \
                f"torch.export specialised {m.group(1)} dim {m.group(2)} to {int(value)}: {cause}"
    return reasons


@dataclass(frozen=True)
class StaticDim:
    """An input dimension the graph accepts at one size only, and why."""
    input: str
    dim: int
    size: int
    reason: str

    def __str__(self) -> str:
        return f"{self.input}[{self.dim}]={self.size} because {self.reason}"


@dataclass(frozen=True)
class InputDims:
    """Dynamic and static input dimensions of a graph (``guarded``: False when no shape guard was recorded)."""
    dynamic: tuple[str, ...]
    static: tuple[StaticDim, ...]
    guarded: bool


def input_dims(gm: fx.GraphModule) -> InputDims:
    """The input dimensions recorded by the graph's shape guard (graph/guards): ``eq`` checks are static,
    every other dimension of a checked rank is dynamic (with its proven range or equal dimension)."""
    from .guards import GUARD_NODE

    guard = next((n for n in gm.graph.nodes if n.op == "call_function" and n.name == GUARD_NODE), None)
    if guard is None:
        return InputDims((), (), False)
    names = list(guard.kwargs["names"])
    checks = [tuple(c) for c in guard.kwargs["checks"]]
    ranks = {c[0]: int(c[3]) for c in checks if c[2] == "rank"}
    static = {(c[0], c[1]): StaticDim(names[c[0]], c[1], int(c[3]), str(c[4])) for c in checks if c[2] == "eq"}
    detail: dict[tuple[int, int], str] = {}
    for i, d, kind, value, _ in checks:
        if kind == "range":
            detail[(i, d)] = f" in [{value[0]}, {'inf' if value[1] is None else value[1]}]"
        elif kind == "same":
            detail[(i, d)] = f" (= {names[value[0]]}[{value[1]}])"
    dynamic = tuple(f"{names[i]}[{d}]{detail.get((i, d), '')}" for i in sorted(ranks) for d in range(ranks[i])
                    if (i, d) not in static)
    return InputDims(dynamic, tuple(static[k] for k in sorted(static)), True)
