"""Small shared queries of the compiler passes: a node's recorded result shape, identity slices."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...graph.metadata import get_meta, has_meta

aten = torch.ops.aten
_FULL = 2**62  # slice ends at or above this mean "to the end" (export writes sys.maxsize)


def result_shape(node: Any) -> tuple[int, ...] | None:
    """The node's result shape from fxforge metadata or the capture's fake value; None when unknown."""
    if not isinstance(node, fx.Node):
        return None
    if has_meta(node):
        res = get_meta(node).common.results.get("data_out_0")
        if res is not None and res.shape is not None:
            return tuple(res.shape)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except TypeError:  # a symbolic size: only its rank is known
            return tuple(-1 for _ in val.shape)
    return None


def result_dtype(node: Any) -> torch.dtype | None:
    if isinstance(node, fx.Node):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.dtype
        if has_meta(node):
            res = get_meta(node).common.results.get("data_out_0")
            if res is not None and res.dtype is not None:
                return getattr(torch, res.dtype)
    return None


def is_identity_slice(node: Any) -> bool:
    """``aten.slice(x, dim, 0, <end>)`` with step 1: a view equal to ``x``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.slice.Tensor):
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= _FULL)) and step in (None, 1)


def strip_identity(node: Any) -> Any:
    """Look through identity slices to the tensor they view."""
    while is_identity_slice(node):
        node = node.args[0]
    return node


def infer_val(node: fx.Node) -> None:
    """Give a node a rewrite created its capture-time fake value (``meta["val"]``) from its inputs'
    fake values, so later shape queries see it; left unset when an input has none."""
    vals = {}
    for inp in node.all_input_nodes:
        val = inp.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        vals[inp] = val
    if not callable(node.target):  # a method or module call, named by a string: no fake value here
        node.meta.pop("val", None)
        return
    args = fx.node.map_arg(node.args, vals.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, vals.__getitem__)
    try:
        node.meta["val"] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- no fake value: shape queries fall back to metadata
        node.meta.pop("val", None)
