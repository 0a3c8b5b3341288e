"""Graph patterns the fused kernels replace, and the rewrites that put ``torch.ops.fxforge.*`` in their place.

Each ``fuse_*`` function looks at one anchor node; when the pattern around it holds it edits the graph
through a :class:`GraphRewrite` and returns the kind it fused (else None). Patterns, in both
frontends' spellings (fx: torch functions, methods and nn modules; export: ATen ops):

* ``softmax``: ``softmax(x, -1)`` -> ``fxforge.softmax``; with ``x = s * c (or s / c) [+ mask]`` feeding
  it -> ``fxforge.scaled_masked_softmax(s, mask, c)``;
* ``softmax_chain``: the naive ``m = max(x, -1); e = exp(x - m); e / sum(e, -1)`` -> ``fxforge.softmax``;
* ``add_layer_norm``: ``layer_norm(a + b)`` -> ``fxforge.add_layer_norm`` (its sum output feeds the
  add's other users); ``layer_norm`` alone -> ``fxforge.layer_norm`` (opt-in);
* ``bias_gelu`` / ``bias_relu``: ``act(linear(x, W, b))`` -> ``act_op(linear(x, W), b)``.

Shapes come from the nodes' recorded metadata (the pass requires it). Weights are read through
``get_attr`` nodes on the original parameters, so names, sharing and training are unchanged.
"""

from __future__ import annotations

import operator
from typing import Any, TypeGuard

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ...graph.ir import classify
from ...graph.metadata import get_meta, has_meta
from ..rewrite import GraphRewrite

_BIG = 2**62


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The recorded result shape of a node (None if unknown or not a node)."""
    if not isinstance(node, fx.Node) or not has_meta(node):
        return None
    value = get_meta(node).common.results.get("data_out_0")
    return None if value is None or value.type != "tensor" or value.shape is None else tuple(value.shape)


def op_of(node: Any, gm: fx.GraphModule) -> str:
    """The canonical op of a node (``""`` for anything that is not a node, e.g. a constant argument)."""
    return classify(node, gm)[1] if isinstance(node, fx.Node) else ""


def is_op(node: object, gm: fx.GraphModule, op: str) -> TypeGuard[fx.Node]:
    """Whether ``node`` is a node computing canonical ``op``: a matcher reads a node's arguments
    (``fx.Node.args`` holds any argument) through this, so what it matched is typed as a node."""
    return isinstance(node, fx.Node) and op_of(node, gm) == op


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional ``index`` or keyword ``name`` of a call (methods count ``self`` as index 0)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, list | tuple):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _erase_dead(rw: GraphRewrite, nodes: list[fx.Node]) -> None:
    """Erase the pattern's nodes that nothing reads any more (in the order given: users first)."""
    for node in nodes:
        for extra in [u for u in node.users if op_of(u, rw.gm) == "getitem" and not u.users]:
            rw.erase(extra)  # e.g. the unused indices output of aten.max.dim
        if not node.users:
            rw.erase(node)


# -- softmax ----------------------------------------------------------------------------------------
def _softmax_input(node: fx.Node, gm: fx.GraphModule) -> fx.Node | None:
    """The input of a last-dim softmax without dtype change (any spelling), else None."""
    if op_of(node, gm) != "softmax":
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        dim, x, dtype = getattr(module, "dim", None), node.args[0] if node.args else None, None
    else:
        x = arg(node, 0, "input")
        dim = arg(node, 1, "dim")
        dtype = arg(node, 2, "dtype") if node.target is not torch.ops.aten._softmax.default else None
        if node.target is torch.ops.aten._softmax.default and node.args[2]:
            return None  # half_to_float
    shape = shape_of(x)
    if not isinstance(x, fx.Node) or shape is None or dtype is not None or not _is_last_dim(dim, len(shape)):
        return None
    return x


def _scale_of(node: Any, gm: fx.GraphModule) -> tuple[fx.Node, float] | None:
    """``(s, c)`` when ``node`` is ``s * c``, ``c * s`` or ``s / c`` with a Python number ``c``."""
    if not isinstance(node, fx.Node) or node.kwargs:
        return None
    op = op_of(node, gm)
    if op == "mul" and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and isinstance(b, int | float) and not isinstance(b, bool):
            return a, float(b)
        if isinstance(b, fx.Node) and isinstance(a, int | float) and not isinstance(a, bool):
            return b, float(a)
    if op == "div" and len(node.args) == 2 and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[1], int | float) and not isinstance(node.args[1], bool) and node.args[1] != 0:
        return node.args[0], 1.0 / float(node.args[1])
    return None


def fuse_softmax(rw: GraphRewrite, node: fx.Node) -> str | None:
    """``softmax(x, -1)``, optionally absorbing a scale and an additive mask in front of it."""
    gm = rw.gm
    x = _softmax_input(node, gm)
    if x is None:
        return None
    out_shape = shape_of(node)
    scores, mask, scale = x, None, 1.0
    absorbed: list[fx.Node] = []
    a, b = x.args if op_of(x, gm) == "add" and len(x.args) == 2 and not x.kwargs and _only_user(x, node) \
        else (None, None)
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if _scale_of(b, gm) is not None and _scale_of(a, gm) is None:
            a, b = b, a
        if shape_of(a) == out_shape and shape_of(b) is not None:
            scores, mask, absorbed = a, b, [x]
    scaled = _scale_of(scores, gm)
    if scaled is not None and _only_user(scores, absorbed[0] if absorbed else node) \
            and shape_of(scaled[0]) == out_shape:
        absorbed.append(scores)
        scores, scale = scaled
    if not absorbed:
        rw.replace(node, "call_function", torch.ops.fxforge.softmax.default, (x,))
        return "softmax"
    rw.replace(node, "call_function", torch.ops.fxforge.scaled_masked_softmax.default, (scores, mask, scale))
    _erase_dead(rw, absorbed)
    return "scaled_masked_softmax"


def _strip_broadcast(node: Any, gm: fx.GraphModule, chain: list[fx.Node]) -> Any:
    """Walk back through no-op re-shapings (full slices, a trailing unsqueeze / ``[..., None]``)."""
    while isinstance(node, fx.Node) and len(node.users) == 1:
        op = op_of(node, gm)
        if op == "slice" and len(node.args) >= 4 and node.args[2] == 0 and isinstance(node.args[3], int) \
                and node.args[3] >= _BIG and (len(node.args) < 5 or node.args[4] == 1):
            pass
        elif op == "unsqueeze":
            pass
        elif op == "getitem" and _is_trailing_none_index(node.args[1]):
            pass
        else:
            break
        chain.append(node)
        node = node.args[0]
    return node


def _is_trailing_none_index(index: object) -> bool:
    """Whether a ``getitem`` index is ``[..., None]`` (full slices or an ellipsis, then one new axis)."""
    return isinstance(index, tuple) and bool(index) and index[-1] is None \
        and all(s == slice(None) or s is Ellipsis for s in index[:-1])


def _reduced(node: Any, gm: fx.GraphModule, kind: str, chain: list[fx.Node]) -> fx.Node | None:
    """The input of a last-dim ``max`` (values) / ``amax`` / ``sum`` reduction ending at ``node``."""
    if not isinstance(node, fx.Node):
        return None
    op = op_of(node, gm)
    if kind == "max" and op == "getitem" and node.args[1] == 0 and len(node.users) == 1:
        inner = node.args[0]
        if not is_op(inner, gm, "max") or not all(
                op_of(u, gm) == "getitem" and (u is node or not u.users) for u in inner.users):
            return None
        chain += [node, inner]
        node, op = inner, "max"
    elif kind == "max" and op == "amax" and len(node.users) == 1:
        chain.append(node)
    elif kind == "sum" and op == "sum":
        chain.append(node)
    else:
        return None
    src = arg(node, 0, "input")
    shape = shape_of(src)
    if shape is None or not _is_last_dim(arg(node, 1, "dim"), len(shape)) or arg(node, 3, "dtype") is not None:
        return None
    return src


def fuse_softmax_chain(rw: GraphRewrite, node: fx.Node) -> str | None:
    """The naive chain ``exp(x - max(x)) / sum(exp(x - max(x)))`` over the last dim, ending at a division."""
    gm = rw.gm
    if op_of(node, gm) != "div" or node.kwargs or len(node.args) != 2:
        return None
    num, den = node.args
    if not is_op(num, gm, "exp") or not isinstance(den, fx.Node) or node not in num.users:
        return None
    den_chain: list[fx.Node] = []
    if _reduced(_strip_broadcast(den, gm, den_chain), gm, "sum", den_chain) is not num or len(num.users) != 2:
        return None
    sub = num.args[0]
    if not is_op(sub, gm, "sub") or sub.kwargs or not _only_user(sub, num):
        return None
    x, mb = sub.args
    max_chain: list[fx.Node] = []
    if not isinstance(x, fx.Node) or _reduced(_strip_broadcast(mb, gm, max_chain), gm, "max", max_chain) is not x:
        return None
    x_shape = shape_of(x)
    if x_shape is None:  # _reduced matched x only with a known shape
        return None
    want = (*x_shape[:-1], 1)
    if shape_of(den) != want or shape_of(mb) != want:
        return None
    rw.replace(node, "call_function", torch.ops.fxforge.softmax.default, (x,))
    _erase_dead(rw, [*den_chain, num, sub, *max_chain])
    return "softmax_chain"


# -- layer norm -------------------------------------------------------------------------------------
def _layer_norm_parts(node: fx.Node, gm: fx.GraphModule) -> tuple[Any, Any, Any, float] | None:
    """(input, weight, bias, eps) of a last-dim LayerNorm; weight/bias as parameter paths or nodes."""
    if op_of(node, gm) != "layer_norm":
        return None
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if not isinstance(m, nn.LayerNorm) or len(m.normalized_shape) != 1 or len(node.args) != 1:
            return None
        w = f"{node.target}.weight" if m.weight is not None else None
        b = f"{node.target}.bias" if m.bias is not None else None
        return node.args[0], w, b, float(m.eps)
    if node.target not in (F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm.default):
        return None
    shape = arg(node, 1, "normalized_shape")
    if not isinstance(shape, list | tuple) or len(shape) != 1:
        return None
    return arg(node, 0, "input"), arg(node, 2, "weight"), arg(node, 3, "bias"), float(arg(node, 4, "eps", 1e-5))


def fuse_layer_norm(rw: GraphRewrite, node: fx.Node, with_add: bool, alone: bool) -> str | None:
    """``layer_norm(a + b)`` -> ``add_layer_norm`` (when ``with_add``), a bare one -> ``layer_norm`` (``alone``)."""
    gm = rw.gm
    parts = _layer_norm_parts(node, gm)
    if parts is None:
        return None
    x, w, b, eps = parts
    add = x if with_add and op_of(x, gm) == "add" and not x.kwargs and len(x.args) == 2 else None
    if add is not None and not (all(isinstance(a, fx.Node) for a in add.args)
                                and shape_of(add.args[0]) == shape_of(add.args[1]) == shape_of(add)):
        add = None
    if add is None and not alone:
        return None
    if add is None:
        wn = rw.get_attr(w, before=node) if isinstance(w, str) else w
        bn = rw.get_attr(b, before=node) if isinstance(b, str) else b
        rw.replace(node, "call_function", torch.ops.fxforge.layer_norm.default, (x, wn, bn, eps))
        return "layer_norm"
    order = rw.order()
    if all(order[u] > order[node] for u in add.users if u is not node):
        anchor = node  # every other reader of the sum comes later: build the fused op where the norm was
    elif isinstance(w, str | None) and isinstance(b, str | None):
        anchor = add.next  # the sum is read before the norm: build it right after the add
    else:
        return None
    wn = rw.get_attr(w, before=anchor) if isinstance(w, str) else w
    bn = rw.get_attr(b, before=anchor) if isinstance(b, str) else b
    fused = rw.call_function(torch.ops.fxforge.add_layer_norm.default, (*add.args, wn, bn, eps), before=anchor)
    y = rw.call_function(operator.getitem, (fused, 0), after=fused)
    rw.bypass(node, y)
    if len(add.users) > 0:
        s = rw.call_function(operator.getitem, (fused, 1), after=y)
        rw.bypass(add, s)
    else:
        _erase_dead(rw, [add])
    return "add_layer_norm"


# -- bias + activation ------------------------------------------------------------------------------
def _activation(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str] | None:
    """("gelu", approximate) or ("relu", "") for a single-input activation node, else None."""
    op = op_of(node, gm)
    if op not in ("gelu", "relu") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if getattr(m, "inplace", False):
            return None
        return (op, getattr(m, "approximate", "none")) if op == "gelu" else (op, "")
    if op == "relu":
        return None if len(node.args) > 1 or node.kwargs.get("inplace") else (op, "")
    approximate = arg(node, 1, "approximate", "none")
    return (op, approximate) if approximate in ("none", "tanh") else None


def fuse_bias_activation(rw: GraphRewrite, node: fx.Node) -> str | None:
    """``act(linear(x, W, b))`` whose linear feeds only the activation -> ``act_op(linear(x, W), b)``."""
    gm = rw.gm
    act = _activation(node, gm)
    if act is None:
        return None
    lin = node.args[0]
    if not is_op(lin, gm, "linear") or not _only_user(lin, node):
        return None
    if lin.op == "call_module":
        m = gm.get_submodule(str(lin.target))
        if type(m) is not nn.Linear or m.bias is None or len(lin.args) != 1 or lin.kwargs:
            return None
        x = lin.args[0]
        w, b = (rw.get_attr(f"{lin.target}.{p}", before=lin) for p in ("weight", "bias"))
        target: Any = F.linear
    else:
        x, w, b = arg(lin, 0, "input"), arg(lin, 1, "weight"), arg(lin, 2, "bias")
        if not isinstance(b, fx.Node) or len(shape_of(b) or ()) != 1:
            return None
        target = lin.target
    rw.replace(lin, "call_function", target, (x, w))
    if act[0] == "gelu":
        rw.replace(node, "call_function", torch.ops.fxforge.bias_gelu.default, (lin, b, act[1]))
        return "bias_gelu"
    rw.replace(node, "call_function", torch.ops.fxforge.bias_relu.default, (lin, b))
    return "bias_relu"
