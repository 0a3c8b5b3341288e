"""Where AWQ's inverse input scale goes: folded into the value's producer, or an explicit ChannelScale node.

A group of linears reading one value ``x`` gets its weights multiplied by ``diag(s)``; ``x`` must then be
divided by ``s`` exactly. When everything that reads ``x`` is in the group, the division is folded into the
op that produced it: a LayerNorm / RMSNorm module (weight and bias), a float Linear (its output rows), an
elementwise ``mul`` by a per-channel parameter (HF RMSNorm as torch.export captures it: ``weight * x``) or a
``mul`` with a Linear's output (Llama's ``act(gate) * up``: into ``up``'s rows). Otherwise a
:class:`ChannelScale` node multiplying by ``1/s`` is inserted before the group (registered in graph/targets,
so checkpoints rebuild it; no quantizer is put around it).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph import targets
from ..rewrite import GraphRewrite

__all__ = ["ChannelScale", "CONTAINER", "fold_inverse_scale"]

CONTAINER = "fxforge_awq"  # submodule holding inserted ChannelScale modules
_MULS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
_NORMS = (nn.LayerNorm, nn.RMSNorm)
_SHAPE_METHODS = ("size", "dim")
_SHAPE_ATTRS = ("shape", "dtype", "device", "ndim")


class ChannelScale(nn.Module):
    """``x * scale`` along the last dimension: the inverse AWQ input scale of the linears that read its output."""

    fxforge_op = "channel_scale"
    scale: torch.Tensor

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(int(channels)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"channels={self.scale.numel()}"


def _channel_scale_from_config(config: dict[str, Any]) -> ChannelScale:
    channels = config.get("channels")
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ValueError(f"ChannelScale config: channels must be a positive int, got {channels!r}")
    return ChannelScale(channels)


targets.register_module(ChannelScale, lambda m: {"channels": int(m.scale.numel())}, _channel_scale_from_config,
                        name="fxforge.quantize.ChannelScale", keys=("channels",))


class _Owners:
    """How often each module is called and each parameter held, so a fold never changes a shared tensor."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.calls: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.op == "call_module":
                self.calls[str(node.target)] = self.calls.get(str(node.target), 0) + 1
            elif node.op == "get_attr":
                self.reads[str(node.target)] = self.reads.get(str(node.target), 0) + 1
        self.holders: dict[int, int] = {}
        for _, p in gm.named_parameters(remove_duplicate=False):
            self.holders[id(p)] = self.holders.get(id(p), 0) + 1

    def private_module(self, node: fx.Node) -> nn.Module | None:
        """The module a call_module node calls, when no other node calls it and it shares no parameter."""
        if node.op != "call_module" or self.calls.get(str(node.target), 0) != 1:
            return None
        module = self.gm.get_submodule(str(node.target))
        return module if all(self.holders.get(id(p), 0) == 1 for p in module.parameters()) else None

    def private_parameter(self, node: Any) -> nn.Parameter | None:
        """The parameter a get_attr node reads, when it is read once, by one user, and held once."""
        if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1 \
                or self.reads.get(str(node.target), 0) != 1:
            return None
        try:
            p = self.gm.get_parameter(str(node.target))
        except AttributeError:
            return None
        return p if self.holders.get(id(p), 0) == 1 else None


def _reads_shape(node: fx.Node) -> bool:
    """A node that reads only its input's shape / dtype (``x.size(0)``), which a scale leaves as it is."""
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) == 2 and node.args[1] in _SHAPE_ATTRS
        return node.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)
    return False


def _divide(t: torch.Tensor | None, s: torch.Tensor, axis: int) -> None:
    """``t /= s`` along ``axis`` in float64, in place (t None: nothing)."""
    if t is None:
        return
    shape = [1] * t.dim()
    shape[axis] = -1
    with torch.no_grad():
        t.copy_((t.detach().double() / s.reshape(shape)).to(t.dtype))


def _linear_rows(owners: _Owners, node: Any, channels: int, users: int) -> nn.Linear | None:
    """The float nn.Linear a node calls, producing ``channels`` outputs read by ``users`` nodes only."""
    if not isinstance(node, fx.Node) or len(node.users) != users:
        return None
    module = owners.private_module(node)
    return module if type(module) is nn.Linear and module.out_features == channels else None


def _fold(owners: _Owners, x: fx.Node, s: torch.Tensor) -> str | None:
    """Divide ``x`` by ``s`` inside its producer; where it went, or None when no producer takes it."""
    c = s.numel()
    module = owners.private_module(x)
    if isinstance(module, _NORMS) and getattr(module, "weight", None) is not None \
            and tuple(module.weight.shape) == (c,):
        _divide(module.weight, s, 0)
        _divide(getattr(module, "bias", None), s, 0)
        return f"{x.target} ({type(module).__name__})"
    if _linear_rows(owners, x, c, len(x.users)) is not None:
        lin = owners.private_module(x)
        assert isinstance(lin, nn.Linear)
        _divide(lin.weight, s, 0)
        _divide(lin.bias, s, 0)
        return f"{x.target} (Linear rows)"
    if x.op == "call_function" and x.target in _MULS and len(x.args) == 2 and not x.kwargs:
        for arg in x.args:  # a per-channel parameter: an RMSNorm's weight as export captures it
            p = owners.private_parameter(arg)
            if p is not None and p.numel() == c and p.shape[-1] == c:
                assert isinstance(arg, fx.Node)
                _divide(p, s, p.dim() - 1)
                return f"{arg.target} (mul {x.name})"
        for arg in x.args:  # act(gate) * up: up's rows
            lin = _linear_rows(owners, arg, c, 1)
            if lin is not None and isinstance(arg, fx.Node):
                _divide(lin.weight, s, 0)
                _divide(lin.bias, s, 0)
                return f"{arg.target} (Linear rows, mul {x.name})"
    return None


def fold_inverse_scale(rw: GraphRewrite, x: fx.Node, members: Iterable[fx.Node], s: torch.Tensor, *,
                       like: torch.Tensor) -> str:
    """Make every member (a linear whose weight was multiplied by ``diag(s)``) read ``x / s``; where ``1/s`` went.

    Folded into ``x``'s producer when the members are all that read ``x``, else a ChannelScale node inserted
    before the first member (its scale in ``like``'s dtype and device). Touched nodes are marked for the rewrite
    engine's metadata upkeep.
    """
    members = list(members)
    s = s.detach().double()
    owners = _Owners(rw.gm)
    if {u for u in x.users if not _reads_shape(u)} <= set(members):
        where = _fold(owners, x, s)
        if where is not None:
            rw.touch(x, *members)
            return where
    order = rw.order()
    first = min(members, key=lambda n: order[n])
    path = f"{CONTAINER}.{x.name}"
    module = ChannelScale(s.numel())
    module.scale = (1.0 / s).to(dtype=like.dtype, device=like.device)
    new = rw.call_module(path, module, (x,), before=first)
    for m in members:
        rw.set_arg(m, 0, new)
    return f"{path} (ChannelScale)"
