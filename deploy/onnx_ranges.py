"""A range guard in an ONNX file: ONNX Runtime refuses an input whose dynamic axis is outside the range the graph
accepts, loudly, naming the input, the axis and the range, before any other node reads the input.

ONNX has no assertion op and its types carry no size bounds, so ORT runs an exported graph at any size. Measured
on the tiny BERT export (guard: sequence 2..64): at 65 ORT failed inside the graph ("invalid expand shape" at
``node_expand_1``: the token-type buffer, sliced to its 64 rows) and a copy taking ``token_type_ids`` as an input
failed at an ``Add`` broadcast, naming neither input nor bound; at 1 it ran (outside the proven range, so
unchecked). The guard per input::

    s   = Shape(x, start=axis, end=axis+1)            # one per guarded axis
    idx = Min(max - s, s - min, 0) - 1                # -1 inside the range, below -1 outside it
    g   = Gather([0], idx)                            # node named "fxforge range guard: x axis 1 (seq) must be ..."
    x'  = Where(Cast(g, bool), x, x)                  # x itself, bit for bit, but only once every g ran

and every reader of ``x`` reads ``x'``, so no node runs on an input the guard has not passed. ``Gather`` fails on
an out-of-range index with ORT's "indices element out of data bounds" and the node's name. ``Where`` keeps the
input's shape (broadcasting a one-element condition), so ORT's shape inference and fusions see the same graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["guard_ranges", "guard_ranges_file", "GUARD_PREFIX", "guarded_axes"]

GUARD_PREFIX = "fxforge range guard"
_WHERE_TYPES = ("FLOAT", "DOUBLE", "FLOAT16", "INT32", "INT64", "UINT8", "BOOL")  # ORT's CPU Where kernel


def guarded_axes(ranges: dict[str, dict[int, tuple[int, int | None]]]) -> dict[str, dict[int, tuple[int, int | None]]]:
    """The axes worth a guard: an upper bound, or a lower bound above 1 (1..unbounded is any batch)."""
    return {name: {a: r for a, r in axes.items() if r[1] is not None or r[0] > 1}
            for name, axes in ranges.items() if any(r[1] is not None or r[0] > 1 for r in axes.values())}


def _message(name: str, axis: int, label: str, lo: int, hi: int | None) -> str:
    bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    return f"{GUARD_PREFIX}: {name} axis {axis} ({label}) must be {bound}"


def guard_ranges(model: Any, ranges: dict[str, dict[int, tuple[int, int | None]]],
                 labels: dict[str, dict[int, str]]) -> int:
    """Add a range guard (module docstring) to the ``onnx.ModelProto`` ``model`` for each input axis in
    ``ranges`` that :func:`guarded_axes` keeps; returns the number of guarded axes. An input of a type ORT's
    ``Where`` cannot pass through is left unguarded (the check runner still refuses it)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    taken = {v for n in graph.node for v in (*n.input, *n.output)} | {i.name for i in graph.initializer} \
        | {i.name for i in graph.input}
    counter = iter(range(1 << 30))

    def fresh(stem: str) -> str:
        while True:
            name = f"fxforge_range_guard.{stem}.{next(counter)}"
            if name not in taken:
                taken.add(name)
                return name

    inputs = {i.name: i for i in graph.input}
    zero, one, table = fresh("zero"), fresh("one"), fresh("table")
    head: list[Any] = []
    renamed: dict[str, str] = {}
    count = 0
    for name, axes in guarded_axes(ranges).items():
        if name not in inputs:
            continue
        elem = TensorProto.DataType.Name(inputs[name].type.tensor_type.elem_type)
        if elem not in _WHERE_TYPES:
            continue
        gathered = []
        for axis, (lo, hi) in sorted(axes.items()):
            size, terms = fresh(f"{name}.size"), []
            head.append(helper.make_node("Shape", [name], [size], start=axis, end=axis + 1))
            for bound, left_first in ((hi, True), (lo if lo > 0 else None, False)):
                if bound is None:
                    continue
                const, term = fresh("bound"), fresh("slack")
                graph.initializer.append(numpy_helper.from_array(np.array([bound], np.int64), const))
                head.append(helper.make_node("Sub", [const, size] if left_first else [size, const], [term]))
                terms.append(term)
            low, idx, g = fresh("low"), fresh("index"), fresh("ok")
            head += [helper.make_node("Min", [*terms, zero], [low]), helper.make_node("Sub", [low, one], [idx]),
                     helper.make_node("Gather", [table, idx], [g],
                                      name=_message(name, axis, labels.get(name, {}).get(axis, f"dim{axis}"), lo, hi))]
            gathered.append(g)
            count += 1
        if len(gathered) > 1:
            joined, top = fresh("joined"), fresh("top")
            head += [helper.make_node("Concat", gathered, [joined], axis=0),
                     helper.make_node("ReduceMax", [joined], [top], keepdims=1)]
            gathered = [top]
        cond, checked = fresh("cond"), fresh(f"{name}.checked")
        head += [helper.make_node("Cast", [gathered[0]], [cond], to=TensorProto.BOOL),
                 helper.make_node("Where", [cond, name, name], [checked])]
        renamed[name] = checked
    if not count:
        return 0
    graph.initializer.extend([numpy_helper.from_array(np.zeros(1, np.int64), zero),
                              numpy_helper.from_array(np.ones(1, np.int64), one),
                              numpy_helper.from_array(np.zeros(1, np.int64), table)])
    for node in graph.node:
        for i, value in enumerate(node.input):
            if value in renamed:
                node.input[i] = renamed[value]
    nodes = [*head, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def guard_ranges_file(path: str | Path, ranges: dict[str, dict[int, tuple[int, int | None]]],
                      labels: dict[str, dict[int, str]]) -> int:
    """:func:`guard_ranges` on the ONNX file ``path``, rewritten in place (external weights stay where they are)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    count = guard_ranges(model, ranges, labels)
    if count:
        onnx.save(model, str(path))
    return count
