"""conv_bn_fusion_transform_pass: fold eval-mode BatchNorm into the conv / linear layer before it (MASE's pass).

In eval mode ``BN(conv(x)) = conv'(x)`` with ``W' = W * s`` and ``b' = (b - mean) * s + beta`` per output
channel, ``s = gamma / sqrt(running_var + eps)``: the BatchNorm node disappears and the layer's weights
change (folded in float64, then cast back). A pair is folded only when the layer's output feeds the BatchNorm
alone and each module is called from one node; other pairs are skipped with the reason in ``info.skipped``.
Training mode normalises with batch statistics, which no folded weight reproduces: the pass refuses such a
graph (``training: "skip"`` leaves training-mode pairs instead).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import get_meta, has_meta
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo
from ..rewrite import GraphRewrite

__all__ = ["ConvBnFusionArgs", "ConvBnFusionInfo", "conv_bn_fusion_transform_pass", "fold_batch_norm"]

# BatchNorm type -> the layers (exact types: a quantized or pruned subclass keeps its own semantics) it folds into
_FOLDS: dict[type[nn.Module], tuple[type[nn.Module], ...]] = {
    nn.BatchNorm1d: (nn.Conv1d, nn.Linear),
    nn.BatchNorm2d: (nn.Conv2d,),
    nn.BatchNorm3d: (nn.Conv3d,),
}


@dataclass(frozen=True)
class ConvBnFusionArgs:
    """training: what to do with a pair in training mode: ``"refuse"`` (an error naming the BatchNorms; call
    ``graph.eval()`` first) or ``"skip"`` (leave the pair, listed in ``info.skipped``)."""

    training: Literal["refuse", "skip"] = "refuse"


@dataclass(frozen=True)
class ConvBnFusionInfo(PassInfo):
    """fused: ``(layer path, BatchNorm path)`` folded; skipped: BatchNorm path -> why it was left."""

    fused: list[tuple[str, str]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def fold_batch_norm(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` (Conv1d/2d/3d or Linear) computing ``bn(layer(x))`` with ``bn``'s running statistics."""
    assert bn.running_mean is not None and bn.running_var is not None
    weight, layer_bias = layer.weight, layer.bias
    assert isinstance(weight, torch.Tensor) and (layer_bias is None or isinstance(layer_bias, torch.Tensor))
    mean, var = bn.running_mean.double(), bn.running_var.double()
    gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma / torch.sqrt(var + bn.eps)
    bias = layer_bias.double() if layer_bias is not None else torch.zeros_like(mean)
    new = copy.deepcopy(layer)
    with torch.no_grad():
        w = weight.double() * scale.reshape(-1, *([1] * (weight.dim() - 1)))
        new.weight = nn.Parameter(w.to(weight.dtype), requires_grad=weight.requires_grad)
        new.bias = nn.Parameter(((bias - mean) * scale + beta).to(weight.dtype), requires_grad=weight.requires_grad)
    return new


def _rank(node: fx.Node) -> int | None:
    """Rank of the node's output when capture or metadata recorded it."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim()
    if has_meta(node):
        res = get_meta(node).common.results.get("data_out_0")
        if res is not None and res.shape is not None:
            return len(res.shape)
    return None


def _why_not(node: fx.Node, src: object, gm: fx.GraphModule, calls: Counter[str]) -> str | None:
    """None when the BatchNorm ``node`` folds into its input's layer, else the reason it does not."""
    bn = gm.get_submodule(str(node.target))
    if not isinstance(src, fx.Node) or src.op != "call_module":
        return "its input is not a layer's output"
    layer = gm.get_submodule(str(src.target))
    if type(layer) not in _FOLDS[type(bn)]:
        return f"its input comes from a {type(layer).__name__}, not one of {[c.__name__ for c in _FOLDS[type(bn)]]}"
    if len(src.users) != 1:
        return f"the output of {src.target!r} also feeds {[u.name for u in src.users if u is not node]}"
    if calls[str(src.target)] != 1 or calls[str(node.target)] != 1:
        return "the layer or the BatchNorm is called from more than one node"
    if not bn.track_running_stats or bn.running_mean is None:
        return "it keeps no running statistics (track_running_stats=False): it always uses batch statistics"
    if isinstance(layer, nn.Linear) and _rank(src) != 2:
        return "a BatchNorm1d after a Linear folds only on 2-D (batch, features) outputs"
    return None


@forge_pass("transform", ConvBnFusionArgs, info=ConvBnFusionInfo, forbids=("pipeline-stages",),
            contract=NumericalContract("exact", atol=1e-5, rtol=1e-5, note="eval-mode BatchNorm folded into weights"))
def conv_bn_fusion_transform_pass(graph: ForgeGraph, args: ConvBnFusionArgs
                                  ) -> tuple[ForgeGraph, ConvBnFusionInfo]:
    """Fold each eval-mode BatchNorm into the Conv1d/2d/3d (or Linear, for BatchNorm1d on 2-D outputs) whose
    output it alone reads; outputs stay within 1e-5. Training-mode pairs are refused (or skipped)."""
    gm = graph.model
    calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    pairs: list[tuple[fx.Node, fx.Node]] = []
    skipped: dict[str, str] = {}
    training: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or type(gm.get_submodule(str(node.target))) not in _FOLDS:
            continue
        src = node.args[0] if node.args else None
        reason = _why_not(node, src, gm, calls)
        if reason is not None:
            skipped[str(node.target)] = reason
            continue
        assert isinstance(src, fx.Node)
        if gm.get_submodule(str(node.target)).training or gm.get_submodule(str(src.target)).training:
            training.append(str(node.target))
            if args.training == "skip":
                skipped[str(node.target)] = "training mode: it normalises with batch statistics"
            continue
        pairs.append((src, node))
    if training and args.training == "refuse":
        raise ValueError(f"BatchNorm {training[:4]}{' ...' if len(training) > 4 else ''} is in training mode, where "
                         "it normalises with batch statistics that no folded weight reproduces; call graph.eval() "
                         "first, or pass {'training': 'skip'} to leave those pairs")
    fused: list[tuple[str, str]] = []
    with GraphRewrite(gm) as rw:
        for src, node in pairs:
            bn = gm.get_submodule(str(node.target))
            assert isinstance(bn, nn.modules.batchnorm._BatchNorm)
            rw.set_module(str(src.target), fold_batch_norm(gm.get_submodule(str(src.target)), bn))
            rw.bypass(node, src)
            fused.append((str(src.target), str(node.target)))
    return graph, ConvBnFusionInfo(fused=fused, skipped=skipped)
