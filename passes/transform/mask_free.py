"""mask_free_activations_transform_pass: ReLU / softshrink whose backward keeps a float mask, not a bool one.

Why: for ``relu`` and ``softshrink`` the AOT partitioner of ``torch.compile`` saves the backward's mask
as a ``bool`` tensor (1 byte per element, the cheapest to keep), and Inductor's C++ code on AVX2 stores
a bool vector by converting the float mask element by element (``VecMask<float>::store(bool*)``):
measured here, storing ``x <= 0`` for 262,144 floats takes 2.3-2.9 ms against 0.05 ms for a scalar
loop (``benchmarks/bench_afno_compile.py`` profiles it; one such store per mixer activation per step).

The rewrite calls :func:`mask_free_relu` / :func:`mask_free_softshrink` instead. In eager mode they are
``F.relu`` / ``F.softshrink`` (nothing changes). Under ``torch.compile`` they are autograd functions
whose forward is the same op and whose backward multiplies by a float mask built without any
comparison (``relu(sign(.))``), so no bool tensor exists for the partitioner to save.

Contract: outputs bitwise equal; gradients equal for every non-NaN input (including ``+-inf`` and
inputs exactly at the threshold). For a NaN input the compiled gradient is 0 where PyTorch passes the
incoming gradient through (``sign(nan) == 0``); the output there is NaN either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ...graph import targets
from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite
from ..select import Selector, parse_selector_fields, select_nodes
from .fusion_patterns import arg

__all__ = ["MASK_FREE_OPS", "mask_free_relu", "mask_free_softshrink", "mask_free_activations_transform_pass"]

MASK_FREE_OPS: tuple[str, ...] = ("relu", "softshrink")


class _ReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(torch.relu(torch.sign(x)))  # 1 where x > 0, else 0: what ReLU's gradient passes
        return torch.relu(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class _Softshrink(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, lambd: float) -> Tensor:
        ctx.save_for_backward(torch.relu(torch.sign(x.abs() - lambd)))  # 1 where |x| > lambd, else 0
        return F.softshrink(x, lambd)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def mask_free_relu(x: Tensor) -> Tensor:
    """``F.relu(x)``; under ``torch.compile`` its backward keeps a float mask (see the module doc)."""
    if not (torch.compiler.is_compiling() and x.requires_grad and torch.is_grad_enabled()):
        return F.relu(x)
    return _ReLU.apply(x)


def mask_free_softshrink(x: Tensor, lambd: float = 0.5) -> Tensor:
    """``F.softshrink(x, lambd)``; under ``torch.compile`` its backward keeps a float mask."""
    if not (torch.compiler.is_compiling() and x.requires_grad and torch.is_grad_enabled()):
        return F.softshrink(x, lambd)
    return _Softshrink.apply(x, lambd)


targets.register_function(mask_free_relu, name="fxforge.mask_free_relu")
targets.register_function(mask_free_softshrink, name="fxforge.mask_free_softshrink")


@dataclass(frozen=True)
class MaskFreeArgs:
    """ops: which of MASK_FREE_OPS to rewrite; targets / exclude: the shared selector on the activation
    nodes (None: every match)."""

    ops: tuple[str, ...] = MASK_FREE_OPS
    targets: Any = None
    exclude: Any = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(MASK_FREE_OPS))
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; allowed: {list(MASK_FREE_OPS)}")
        parse_selector_fields(self)


@dataclass(frozen=True)
class MaskFreeInfo(PassInfo):
    """rewritten: count per op; names: the nodes rewritten; skipped: matching nodes left alone
    (in-place forms, or arguments the rewrite cannot read), by name."""

    rewritten: dict[str, int] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()


def _call(node: fx.Node, gm: fx.GraphModule, op: str) -> tuple[Any, ...] | None:
    """``(input,)`` for a ReLU, ``(input, lambd)`` for a softshrink, or None for forms not rewritten."""
    x = arg(node, 0, "input")  # a method's self is its argument 0
    if not isinstance(x, fx.Node):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if len(node.args) != 1 or node.kwargs or getattr(module, "inplace", False):
            return None
        if isinstance(module, nn.ReLU):
            return (x,)
        return (x, float(module.lambd)) if isinstance(module, nn.Softshrink) else None
    if op == "relu":
        inplace = node.kwargs.get("inplace") or (len(node.args) > 1 and node.args[1])
        in_place_op = "relu_" in str(getattr(node.target, "__name__", node.target)).split(".")
        return None if inplace or in_place_op else (x,)
    lambd = arg(node, 1, "lambd", 0.5)
    return (x, float(lambd)) if isinstance(lambd, int | float) and not isinstance(lambd, bool) else None


@forge_pass("transform", MaskFreeArgs, info=MaskFreeInfo,
            contract=NumericalContract("exact", atol=0.0, rtol=0.0,
                                       note="outputs bitwise; gradients for non-NaN inputs"))
def mask_free_activations_transform_pass(graph: ForgeGraph,
                                         args: MaskFreeArgs) -> tuple[ForgeGraph, MaskFreeInfo]:
    """Rewrite ReLU / softshrink nodes into :func:`mask_free_relu` / :func:`mask_free_softshrink`."""
    gm = graph.model
    rewritten: dict[str, int] = {}
    names: list[str] = []
    skipped: list[str] = []
    targets = args.targets if args.targets is not None else Selector.parse({"type": list(args.ops)})
    with GraphRewrite(gm) as rw:
        for node, name, _, op in list(select_nodes(gm, targets, args.exclude)):
            if op not in args.ops:
                continue
            call = _call(node, gm, op)
            if call is None:
                skipped.append(name)
                continue
            rw.replace(node, "call_function", mask_free_relu if op == "relu" else mask_free_softshrink, call)
            rewritten[op] = rewritten.get(op, 0) + 1
            names.append(name)
    return graph, MaskFreeInfo(rewritten=rewritten, names=tuple(names), skipped=tuple(skipped))
