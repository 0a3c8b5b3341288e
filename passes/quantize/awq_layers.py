"""The linears AWQ scales, grouped by the value they read, and the quantized linears it leaves (with why).

A member is a linear whose weight the config quantizes and whose input columns can be scaled exactly: an
``nn.Linear``, a ``PrunedLinear`` without activation sparsity (its masks commute with a column scale), a LoRA
``LoraLinear`` (the base weight and ``lora_A`` are both scaled; ``lora_B`` reads A's output) or a functional
``linear(x, W, b)`` whose weight is a parameter read nowhere else (fuse_kernels leaves these). A layer called
from several nodes, or holding a parameter another module holds too (tied heads), is left to round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..select import node_identity
from .config import QuantizeConfig
from .modules import QuantizedLinear
from .quantizer import Quantize

__all__ = ["Member", "find_groups"]


@dataclass
class Member:
    """One scaled linear: its report path (module, or weight owner of a functional linear), its node, the weight
    the quantizer sees, other parameters whose columns are scaled with it, its prune mask and weight quantizer."""

    path: str
    node: fx.Node
    weight: torch.Tensor  # the parameter itself (scaled in place)
    quantizer: Quantize
    extra: tuple[torch.Tensor, ...] = ()
    mask: torch.Tensor | None = None

    def float_weight(self) -> torch.Tensor:
        """The weight the layer computes with before quantization (masked for a pruned layer)."""
        w = self.weight.detach().clone()
        return w if self.mask is None else w * self.mask

    @torch.no_grad()
    def set_scaled(self, weight: torch.Tensor, s: torch.Tensor) -> None:
        """Hold ``weight`` (the scaled, maybe clipped, weight) and scale the extra parameters' columns by ``s``."""
        self.weight.copy_(weight.to(self.weight.dtype))
        for p in self.extra:
            p.copy_((p.detach().double() * s.to(p.device)).to(p.dtype))


def weight_quantizer(config: QuantizeConfig, name: str, module: nn.Module | None) -> Quantize | None:
    """The weight quantizer the quantize pass gives this linear (None when it quantizes no weight); a module's and a
    functional linear's weight quantizers share the axes (per output row, blocks along the inputs)."""
    _, cfg = config.rule_for(name, "linear", module)
    spec = cfg.role("weight") if cfg is not None else None
    if spec is None:
        return None
    channel, block = QuantizedLinear.AXES["weight"]
    return Quantize(spec, "weight", is_param=True, channel_axis=channel, block_axis=block)


class _Counts:
    """Calls per module path, reads per get_attr target, holders per parameter: what makes a tensor private."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.calls: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        for node in gm.graph.nodes:
            counts = self.calls if node.op == "call_module" else self.reads if node.op == "get_attr" else None
            if counts is not None:
                counts[str(node.target)] = counts.get(str(node.target), 0) + 1
        self.holders: dict[int, int] = {}
        for _, p in gm.named_parameters(remove_duplicate=False):
            self.holders[id(p)] = self.holders.get(id(p), 0) + 1

    def shared(self, params: Any) -> bool:
        return any(self.holders.get(id(p), 0) != 1 for p in params)


_TIED = "holds a parameter another module holds too (tied): scaling it would change that module"


def _module_member(gm: fx.GraphModule, counts: _Counts, config: QuantizeConfig, node: fx.Node, name: str,
                   module: nn.Module, op: str) -> Member | str | None:
    """The member a call_module node is, why it is left (a string), or None when it is no quantized linear."""
    from ..prune.modules import PrunedLinear  # the prune package imports quantize: imported when used
    from ..transform.lora import LoraLinear

    wrapped = getattr(type(module), "fxforge_wraps", None)
    layer = getattr(module, wrapped) if wrapped is not None else module
    if not isinstance(layer, nn.Linear) or (wrapped is None and op != "linear"):
        return None
    wq = weight_quantizer(config, name, layer)
    if wq is None:
        return None
    if wrapped is not None and not (isinstance(module, LoraLinear) and type(layer) is nn.Linear):
        return f"{type(layer).__name__} wrapped by {type(module).__name__}: AWQ scales LoRA-wrapped nn.Linear only"
    if type(layer) not in (nn.Linear, PrunedLinear):
        return f"{type(layer).__name__}: AWQ scales nn.Linear, PrunedLinear and LoraLinear layers"
    if isinstance(layer, PrunedLinear) and layer.act_sparsity > 0:
        return "PrunedLinear with activation sparsity: its input mask depends on the input's magnitudes"
    if counts.calls.get(name, 0) != 1:
        return f"called from {counts.calls.get(name, 0)} nodes: one scale cannot serve them all"
    if counts.shared(module.parameters()):
        return _TIED
    extra = (module.lora_A,) if isinstance(module, LoraLinear) else ()
    mask = layer.weight_mask if isinstance(layer, PrunedLinear) else None
    return Member(name, node, layer.weight, wq, extra, mask)


def _function_member(gm: fx.GraphModule, counts: _Counts, config: QuantizeConfig, node: fx.Node,
                     name: str) -> Member | str | None:
    """The member a functional ``linear(x, W[, b])`` is, why it is left, or None when its weight is unquantized."""
    if weight_quantizer(config, name, None) is None:
        return None
    w = node.args[1] if len(node.args) > 1 else None
    if not isinstance(w, fx.Node) or w.op != "get_attr" or len(w.users) != 1 \
            or counts.reads.get(str(w.target), 0) != 1:
        return "functional linear whose weight is not a parameter read only here"
    try:
        param = gm.get_parameter(str(w.target))
    except AttributeError:
        return "functional linear whose weight is a buffer, not a parameter"
    if counts.shared([param]):
        return _TIED
    owner = str(w.target).rsplit(".", 1)[0] if "." in str(w.target) else node.name
    wq = weight_quantizer(config, name, None)
    assert wq is not None
    return Member(owner, node, param, wq)


def find_groups(gm: fx.GraphModule, config: QuantizeConfig) -> tuple[dict[fx.Node, list[Member]], dict[str, str]]:
    """Members grouped by the value they read (groups and members in graph order), and linears left (path -> why)."""
    counts = _Counts(gm)
    groups: dict[fx.Node, list[Member]] = {}
    skipped: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function"):
            continue
        name, module, op = node_identity(node, gm)
        if node.op == "call_module" and module is not None:
            found = _module_member(gm, counts, config, node, name, module, op)
        elif op == "linear":
            found = _function_member(gm, counts, config, node, name)
        else:
            continue
        if found is None:
            continue
        x = node.args[0] if node.args else None
        if isinstance(found, Member) and (not isinstance(x, fx.Node) or node.kwargs
                                          or (node.op == "call_module" and len(node.args) != 1)):
            found = "its input is not a single graph value"
        if isinstance(found, str):
            skipped[_report_path(node, name)] = f"{found} (round-to-nearest kept)"
            continue
        assert isinstance(x, fx.Node)
        groups.setdefault(x, []).append(found)
    return groups, skipped


def _report_path(node: fx.Node, name: str) -> str:
    """The path a skipped linear is reported under: its module path, or a functional linear's weight owner."""
    if node.op == "call_function" and len(node.args) > 1 and isinstance(node.args[1], fx.Node) \
            and node.args[1].op == "get_attr" and "." in str(node.args[1].target):
        return str(node.args[1].target).rsplit(".", 1)[0]
    return name
