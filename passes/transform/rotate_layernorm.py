"""Residual-stream rotation of a pre-LayerNorm model (GPT-2 style, the zoo GPT), after SliceGPT / QuaRot.

LayerNorm subtracts the mean, which does not commute with a rotation. So first every writer of the residual
stream is made to write zero-mean vectors along the hidden dimension (each embedding row and each writing
linear's output: W ← W − 1·mean₀(W), b ← b − mean(b)); the stream is then mean-free, every LayerNorm's mean
subtraction a no-op, and its variance the mean of squares: LayerNorm is an RMSNorm. Its γ and β are folded
into the linears reading it (W·diag γ, bias b + W·β), and it becomes ``nn.RMSNorm`` without a scale (same
eps), which commutes with an orthogonal Q. Then the stream is carried rotated: embeddings E·Q, readers W·Q,
writers Qᵀ·W (bias Qᵀ·b). The function is the same, exactly in real arithmetic (fp32: rounding only).

The stream is found from the graph, not from names: every LayerNorm's input must be a sum of embeddings and
linears (through adds, scalar multiples, casts and eval dropout), read only by LayerNorms and those adds,
and every LayerNorm read only by linears. Post-LN models (BERT), whose stream is a LayerNorm's output, fail
this: mode='online'.
"""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..rewrite import GraphRewrite

__all__ = ["PreLNStream", "find_pre_ln_stream", "rotate_pre_ln"]

_aten = torch.ops.aten
_ADDS = (operator.add, operator.iadd, torch.add, _aten.add.Tensor)
_MULS = (operator.mul, operator.imul, torch.mul, _aten.mul.Tensor, _aten.mul.Scalar)
_SHAPE_METHODS = ("size", "dim")
# value-preserving steps a writer's output may pass on its way into the stream (casts, copies, eval dropout)
_PASS_METHODS = ("to", "contiguous", "clone", "float", "type_as")
_PASS_FUNCTIONS = (_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.clone.default,
                   _aten.alias.default, torch.nn.functional.dropout)
_PASS_MODULES = (nn.Dropout, nn.Identity)
_SHAPE_FUNCTIONS = (builtins.getattr, _aten.sym_size.int)


@dataclass
class PreLNStream:
    """The residual stream of a pre-LN model: its width, writers (embeddings, linears), norms and readers."""

    hidden: int = 0
    embeds: list[fx.Node] = field(default_factory=list)
    writers: list[fx.Node] = field(default_factory=list)
    sums: set[fx.Node] = field(default_factory=set)  # the adds, scalar products and casts carrying the stream
    norms: list[fx.Node] = field(default_factory=list)
    readers: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # norm -> linear nodes reading it


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _calls(node: fx.Node, fns: tuple[object, ...], method: str) -> bool:
    return (node.op == "call_function" and node.target in fns) or (node.op == "call_method" and node.target == method)


def _shape_only(user: fx.Node) -> bool:
    return (user.op == "call_method" and user.target in _SHAPE_METHODS) or \
        (user.op == "call_function" and user.target in _SHAPE_FUNCTIONS)


def _width(module: nn.Module | None) -> int:
    """The stream width a norm normalises, an embedding writes or a writing linear produces."""
    if isinstance(module, nn.LayerNorm):
        return int(module.normalized_shape[0])
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    assert isinstance(module, nn.Linear)
    return module.out_features


class _Finder:
    """Walks back from each LayerNorm's input, collecting the writers of the stream it reads."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm, self.s, self.seen = gm, PreLNStream(), set[fx.Node]()

    def writes(self, node: fx.Node, norm: fx.Node) -> str | None:
        """None when ``node`` is a sum of embeddings and linears, else why not."""
        if node in self.seen:
            return None
        module = _module(self.gm, node)
        if isinstance(module, nn.Embedding):
            self.s.embeds.append(node)
        elif type(module) is nn.Linear:
            self.s.writers.append(node)
        elif (isinstance(module, _PASS_MODULES) or (node.op == "call_method" and node.target in _PASS_METHODS)
              or (node.op == "call_function" and node.target in _PASS_FUNCTIONS)) \
                and node.args and isinstance(node.args[0], fx.Node):
            if (why := self.writes(node.args[0], norm)) is not None:
                return why
            self.s.sums.add(node)
        elif _calls(node, _ADDS, "add") and not node.kwargs and len(node.args) == 2 \
                and all(isinstance(a, fx.Node) for a in node.args):
            for arg in node.args:
                assert isinstance(arg, fx.Node)
                if (why := self.writes(arg, norm)) is not None:
                    return why
            self.s.sums.add(node)
        elif _calls(node, _MULS, "mul") and not node.kwargs and len(node.args) == 2 \
                and sum(isinstance(a, fx.Node) for a in node.args) == 1 \
                and all(isinstance(a, (fx.Node, int, float)) for a in node.args):
            arg = next(a for a in node.args if isinstance(a, fx.Node))
            if (why := self.writes(arg, norm)) is not None:
                return why
            self.s.sums.add(node)
        else:
            target = getattr(node.target, "__name__", node.target)
            what = type(module).__name__ if module is not None else f"{node.op} {target}"
            return (f"node {node.name!r} ({what}) adds into the stream LayerNorm {norm.name!r} reads; only embeddings, "
                    "nn.Linear outputs, their sums and scalar multiples may (pre-LN GPT-2 style)")
        self.seen.add(node)
        return None


def find_pre_ln_stream(gm: fx.GraphModule) -> PreLNStream | str:
    """The pre-LN residual stream of ``gm``, or the reason the graph is not a pre-LN model."""
    finder = _Finder(gm)
    s = finder.s
    for node in gm.graph.nodes:
        norm = _module(gm, node)
        if not isinstance(norm, nn.LayerNorm):
            continue
        if len(norm.normalized_shape) != 1:
            return f"LayerNorm {node.target!r} normalises over {tuple(norm.normalized_shape)}, not one hidden dimension"
        if not node.args or not isinstance(node.args[0], fx.Node) or len(node.args) > 1 or node.kwargs:
            return f"LayerNorm {node.target!r} is called with other arguments than one tensor"
        if (why := finder.writes(node.args[0], node)) is not None:
            return why
        readers = [u for u in node.users if not _shape_only(u)]
        for user in readers:
            if type(_module(gm, user)) is not nn.Linear or user.args[0] is not node:
                return (f"LayerNorm {node.target!r} is read by {user.name!r}, which is not an nn.Linear (a post-LN "
                        "model such as BERT carries the norm's output as its stream; a token mixer without linears "
                        "reads it directly)")
        s.norms.append(node)
        s.readers[node] = readers
    if not s.norms:
        return "no LayerNorm in the graph"
    if not s.embeds:
        return "no nn.Embedding writes the stream the LayerNorms read"
    carried = set(s.sums) | set(s.embeds) | set(s.writers)
    allowed = carried | set(s.norms)
    for node in carried:
        for user in node.users:
            if user not in allowed and not _shape_only(user):
                return (f"the residual stream value {node.name!r} is read by {user.name!r}, which is neither a "
                        "LayerNorm nor a residual add: the rotation would reach it unfolded")
    widths = {_width(_module(gm, n)) for n in [*s.norms, *s.embeds, *s.writers]}
    if len(widths) != 1:
        return f"the residual stream's writers and norms disagree on its width: {sorted(widths)}"
    s.hidden = widths.pop()
    involved = [*s.embeds, *s.writers, *(r for rs in s.readers.values() for r in rs)]
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    shared = sorted({str(n.target) for n in involved if counts[str(n.target)] > 1})
    if shared:
        return f"module(s) {shared} are called more than once; the rotation needs each layer on one side of the stream"
    return s


def _new_weight(module: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    """A fresh Parameter (not an in-place copy), so a weight tied to another module is untied, not corrupted."""
    setattr(module, name, nn.Parameter(value.to(like.dtype).to(like.device), requires_grad=like.requires_grad))


@torch.no_grad()
def rotate_pre_ln(gm: fx.GraphModule, s: PreLNStream, q: torch.Tensor) -> tuple[list[str], list[str], bool]:
    """Centre the writers, fold and replace the LayerNorms, rotate the stream by ``q`` (float64, orthogonal).

    Returns (layers rotated, LayerNorms replaced by RMSNorm, whether a tied weight was untied)."""
    reader_of = {r: n for n, rs in s.readers.items() for r in rs}
    linears = list(dict.fromkeys([*s.writers, *reader_of]))
    params = [p for n in [*s.embeds, *linears] for p in gm.get_submodule(str(n.target)).parameters()]
    untied = len({id(p) for p in params}) < len(params)
    with GraphRewrite(gm) as rw:
        for node in s.embeds:
            emb = _module(gm, node)
            assert isinstance(emb, nn.Embedding)
            e = emb.weight.double()
            _new_weight(emb, "weight", (e - e.mean(1, keepdim=True)) @ q, emb.weight)
            rw.touch(node)
        for node in linears:
            lin = _module(gm, node)
            assert isinstance(lin, nn.Linear)
            w = lin.weight.double()
            b = lin.bias.double() if lin.bias is not None else torch.zeros(lin.out_features, dtype=torch.float64)
            if node in reader_of:
                norm = _module(gm, reader_of[node])
                assert isinstance(norm, nn.LayerNorm)
                if norm.bias is not None:
                    b = b + w @ norm.bias.double()
                if norm.weight is not None:
                    w = w * norm.weight.double().unsqueeze(0)
                w = w @ q
            if node in s.writers:
                w, b = q.T @ (w - w.mean(0, keepdim=True)), (b - b.mean()) @ q
            _new_weight(lin, "weight", w, lin.weight)
            if lin.bias is not None:
                _new_weight(lin, "bias", b, lin.bias)
            elif b.abs().max() > 0:  # a LayerNorm's beta folded into a linear without bias: it gains one
                lin.bias = nn.Parameter(b.to(lin.weight.dtype), requires_grad=lin.weight.requires_grad)
            rw.touch(node)
        for node in s.norms:
            norm = _module(gm, node)
            assert isinstance(norm, nn.LayerNorm)
            rw.set_module(str(node.target), nn.RMSNorm(s.hidden, eps=norm.eps, elementwise_affine=False))
    return [str(n.target) for n in [*s.embeds, *linears]], [str(n.target) for n in s.norms], untied
