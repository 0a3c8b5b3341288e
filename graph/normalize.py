"""Normalize a raw captured GraphModule into the fxforge IR (architecture: graph/normalize).

* ATen calls of parametrized layers (linear, embedding, layer_norm, conv1d/2d, batch_norm) made by a
  real ``nn.Linear``/... of the model become call_module nodes on that module, at its original path
  (from ``node.meta["nn_module_stack"]``), so HF parameter names survive -- only when calling the
  module computes exactly that op: its class is the layer class or a subclass that does not override
  ``forward`` (OPT's positional embedding adds an offset in its own forward), and no forward hooks
  are registered. Otherwise the ATen node stays and the capture notes say why.
* Dropout (ATen, in place when nothing else reads its input, or functional; not one called with
  training=False) becomes an ``nn.Dropout`` call_module and SDPA with a baked dropout
  probability becomes :class:`ScaledDotProductAttention` (as do their capture-time stand-ins,
  graph/dropout_tracing): captured in train mode, they would otherwise stay on in eval mode.
* A called module whose class is a constructor-only subclass of a torch.nn checkpoint class is held as that
  base (graph/nn_base), so its checkpoint exports.
* torch.export's ``_guards_fn`` (generated Python) and ``_assert_tensor_metadata`` are dropped; capture
  puts the shape guards back as data (graph/guards). The pytree codegen (HF output structure) is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .dropout_tracing import bind_sdpa, stand_in_kind
from .modules import ScaledDotProductAttention
from .nn_base import hold_as_nn_base
from .normalize_hf import conv1d_linear, inline_regions

aten = torch.ops.aten


@dataclass(frozen=True)
class _LiftSpec:
    """How to recognise an ATen call made by a module of type ``cls``."""

    cls: type[nn.Module]
    input_index: int
    tensor_index: int  # arg holding the module's first tensor (weight, or running_mean for BN)
    tensor_attr: str
    accepts: Callable[[nn.Module, fx.Node], bool] = lambda m, n: True


def _conv_ok(m: nn.Module, node: fx.Node) -> bool:
    return getattr(m, "padding_mode", "zeros") == "zeros"


def _bn_first_tensor(m: nn.Module) -> str:
    return "weight" if getattr(m, "weight", None) is not None else "running_mean"


_LIFTS: dict[Any, _LiftSpec] = {
    aten.linear.default: _LiftSpec(nn.Linear, 0, 1, "weight"),
    aten.embedding.default: _LiftSpec(nn.Embedding, 1, 0, "weight"),
    aten.layer_norm.default: _LiftSpec(nn.LayerNorm, 0, 2, "weight"),
    aten.conv1d.default: _LiftSpec(nn.Conv1d, 0, 1, "weight", _conv_ok),
    aten.conv2d.default: _LiftSpec(nn.Conv2d, 0, 1, "weight", _conv_ok),
    aten.conv1d.padding: _LiftSpec(nn.Conv1d, 0, 1, "weight", _conv_ok),
    aten.conv2d.padding: _LiftSpec(nn.Conv2d, 0, 1, "weight", _conv_ok),
}
_BATCH_NORM = aten.batch_norm.default
_ADDMM = aten.addmm.default
_DROPOUTS = {aten.dropout.default, aten.dropout_.default, F.dropout, torch.dropout}
_SDPA = {aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention}
_DROPPED = {aten._assert_tensor_metadata.default}
# Parameter-free single-input modules: fx keeps them as call_module, export inlines them.
_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LogSoftmax, nn.LeakyReLU, nn.ELU,
    nn.Hardtanh, nn.Mish, nn.Softplus,
)


def _not_exact(module: nn.Module, base: type[nn.Module]) -> str | None:
    """Why calling ``module`` would not compute exactly ``base``'s op (None when it would)."""
    cls = type(module)
    if cls.forward is not base.forward:
        return "overrides forward"
    if module._forward_hooks or module._forward_pre_hooks:
        return "has forward hooks"
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return "global forward hooks are registered"
    return None


def _forward_base(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> type[nn.Module]:
    """The class among ``classes`` whose forward ``module`` should have (the nearest in its MRO)."""
    return next(c for c in type(module).__mro__ if c in classes)


class _Notes:
    """Why ATen calls were left as they are (one note per module)."""

    def __init__(self) -> None:
        self.lines: dict[str, str] = {}

    def keep(self, node: fx.Node, path: str, module: nn.Module, why: str) -> None:
        self.lines.setdefault(path, f"kept ATen call {node.name!r} ({node.target}) unlifted: module '{path}' "
                                    f"({type(module).__name__}) {why}, so calling it is not exactly that op")


def innermost_module(node: fx.Node) -> tuple[str, str] | None:
    """(path, type name) of the innermost module whose forward produced the node."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, typ = list(stack.values())[-1]
    typ_name = typ if isinstance(typ, str) else f"{typ.__module__}.{typ.__qualname__}"
    return str(path), typ_name


def _tensor_of(gm: fx.GraphModule, arg: Any) -> torch.Tensor | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        obj: Any = gm
        for part in str(arg.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None
    return None


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent: nn.Module = root
    *parents, leaf = path.split(".")
    for part in parents:
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            setattr(parent, part, child)
        parent = child
    setattr(parent, leaf, module)


def _has_attr_path(root: nn.Module, path: str) -> bool:
    obj: Any = root
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _fresh_path(gm: fx.GraphModule, model: nn.Module, base: str) -> str:
    path, k = base, 1
    while _has_attr_path(gm, path) or _has_attr_path(model, path):
        path, k = f"{base}_{k}", k + 1
    return path


def _replace_with_module(gm: fx.GraphModule, node: fx.Node, path: str, args: tuple[Any, ...]) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(path, args=args)
    new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace", "val")})
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _owner_module(model: nn.Module, node: fx.Node,
                  cls: type[nn.Module] | tuple[type[nn.Module], ...]) -> tuple[str, nn.Module] | None:
    site = innermost_module(node)
    if site is None:
        return None
    path = site[0]
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return (path, module) if isinstance(module, cls) and path else None


def _lift_layer(gm: fx.GraphModule, model: nn.Module, node: fx.Node, notes: _Notes) -> bool:
    if node.target == _BATCH_NORM:
        spec = _LiftSpec(nn.modules.batchnorm._BatchNorm, 0, 1, "weight")
        owner = _owner_module(model, node, spec.cls)
        if owner is None:
            return False
        attr = _bn_first_tensor(owner[1])
        index = 1 if attr == "weight" else 3
        tensor = _tensor_of(gm, node.args[index])
        if tensor is None or tensor is not getattr(owner[1], attr):
            return False
        why = _not_exact(owner[1], spec.cls)
        if why is not None:
            notes.keep(node, owner[0], owner[1], why)
            return False
        _set_submodule(gm, owner[0], owner[1])
        _replace_with_module(gm, node, owner[0], (node.args[0],))
        return True
    spec = _LIFTS[node.target]
    owner = _owner_module(model, node, spec.cls)
    if owner is None or not spec.accepts(owner[1], node):
        return False
    path, module = owner
    tensor = _tensor_of(gm, node.args[spec.tensor_index])
    if tensor is None or tensor is not getattr(module, spec.tensor_attr):
        return False
    why = _not_exact(module, _forward_base(module, (spec.cls,)))
    if why is not None:
        notes.keep(node, path, module, why)
        return False
    _set_submodule(gm, path, module)
    _replace_with_module(gm, node, path, (node.args[spec.input_index],))
    return True


def _lift_conv1d(gm: fx.GraphModule, model: nn.Module, node: fx.Node, lifted: list[str]) -> None:
    owner = _owner_module(model, node, nn.Module)
    linear = conv1d_linear(gm, node, owner)
    if owner is None or linear is None:
        return
    _set_submodule(gm, owner[0], linear)
    _replace_with_module(gm, node, owner[0], (node.args[1],))
    lifted.append(owner[0])


def _drop_lifted_bn_counters(gm: fx.GraphModule) -> None:
    """Erase ``num_batches_tracked.add_(1)`` of lifted BatchNorms: the module counts in train mode itself
    (kept, the graph would count twice in train mode and keep counting in eval mode)."""
    lifted = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == aten.add_.Tensor and not node.users:
            counter = node.args[0]
            if isinstance(counter, fx.Node) and counter.op == "get_attr" and \
                    str(counter.target).endswith(".num_batches_tracked") and \
                    str(counter.target).rsplit(".", 1)[0] in lifted:
                gm.graph.erase_node(node)


def _invocation_sizes(graph: fx.Graph) -> dict[str, int]:
    """How many call nodes each module invocation (innermost nn_module_stack key) produced."""
    sizes: dict[str, int] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op == "call_function" and stack:
            key = list(stack)[-1]
            sizes[key] = sizes.get(key, 0) + 1
    return sizes


def _lift_activation(gm: fx.GraphModule, model: nn.Module, node: fx.Node, sizes: dict[str, int],
                     notes: _Notes) -> None:
    stack = node.meta.get("nn_module_stack")
    owner = _owner_module(model, node, _ACTIVATIONS)
    if owner is None or not stack or sizes.get(list(stack)[-1]) != 1 or not node.args:
        return
    if not isinstance(node.args[0], fx.Node):
        return
    why = _not_exact(owner[1], _forward_base(owner[1], _ACTIVATIONS))
    if why is not None:
        notes.keep(node, owner[0], owner[1], why)
        return
    _set_submodule(gm, owner[0], owner[1])
    _replace_with_module(gm, node, owner[0], (node.args[0],))


def _dropout_p(node: fx.Node) -> float:
    """The probability a dropout call was given (positional or ``p=``; 0.5 when left out)."""
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    if not isinstance(p, int | float):
        raise TypeError(f"dropout node {node.name!r} has probability {p!r}: expected a number")
    return float(p)


def _dropout_on(node: fx.Node) -> bool:
    """False for a dropout the model calls with training=False (never active: it stays an op)."""
    if len(node.args) > 2:
        return node.args[2] is not False
    return node.kwargs.get("training", node.kwargs.get("train", True)) is not False


def _lift_dropout(gm: fx.GraphModule, model: nn.Module, node: fx.Node) -> None:
    if not _dropout_on(node):
        return
    source = node.args[0] if node.args else None
    if node.target is aten.dropout_.default and isinstance(source, fx.Node) and len(source.users) != 1:
        return  # in place on a value read elsewhere too: an out-of-place module would change what they read
    p = _dropout_p(node)
    owner = _owner_module(model, node, nn.Dropout)
    if owner is not None and owner[1].p == p and _not_exact(owner[1], nn.Dropout) is None:
        path, module = owner
    else:
        site = innermost_module(node)
        base = f"{site[0]}.{node.name}" if site and site[0] else node.name
        path, module = _fresh_path(gm, model, base), nn.Dropout(p)
    _set_submodule(gm, path, module)
    _replace_with_module(gm, node, path, (node.args[0],))


def _lift_sdpa(gm: fx.GraphModule, model: nn.Module, node: fx.Node) -> bool:
    bound = bind_sdpa(node.args, node.kwargs)
    p = float(bound.get("dropout_p", 0.0) or 0.0)
    if p == 0.0:
        return False
    module = ScaledDotProductAttention(
        dropout_p=p, is_causal=bool(bound.get("is_causal", False)), scale=bound.get("scale"),
        enable_gqa=bool(bound.get("enable_gqa", False)),
    )
    site = innermost_module(node)
    path = _fresh_path(gm, model, f"{site[0]}.sdpa" if site and site[0] else "sdpa")
    _set_submodule(gm, path, module)
    args = (bound["query"], bound["key"], bound["value"], bound.get("attn_mask"))
    _replace_with_module(gm, node, path, args)
    return True


def normalize(gm: fx.GraphModule, model: nn.Module, notes: list[str] | None = None) -> fx.GraphModule:
    """Rewrite ``gm`` (captured from ``model``) in place into the fxforge IR and return it.

    Why an ATen call was not lifted onto its module is appended to ``notes`` (the capture notes).
    """
    graph = gm.graph
    kept = _Notes()
    regions: list[str] = []
    inline_regions(gm, regions)
    conv1d: list[str] = []
    sizes = _invocation_sizes(graph)
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in _DROPPED and not node.users:
            graph.erase_node(node)
        elif node.op == "call_function" and (node.target in _LIFTS or node.target == _BATCH_NORM):
            _lift_layer(gm, model, node, kept)
        elif node.op == "call_function" and node.target == _ADDMM:
            _lift_conv1d(gm, model, node, conv1d)
        elif node.op == "call_function" and (node.target in _DROPOUTS or stand_in_kind(node.target) == "dropout"):
            _lift_dropout(gm, model, node)
        elif node.op == "call_function" and (node.target in _SDPA or stand_in_kind(node.target) == "sdpa"):
            _lift_sdpa(gm, model, node)
        elif node.op == "call_function":
            _lift_activation(gm, model, node, sizes, kept)
    _drop_lifted_bn_counters(gm)
    held = hold_as_nn_base(gm, model)  # constructor-only subclasses (EfficientNet's depthwise conv)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    # A plain GraphModule (torch.export's own class refuses train()/eval()) holding only what the
    # graph references; the pytree codegen (HF output structure) travels with the graph.
    out = fx.GraphModule(gm, graph, class_name=type(model).__name__)
    out.delete_all_unused_submodules()
    out.recompile()
    if notes is not None:
        notes.extend(regions)
        if conv1d:
            notes.append(f"HF Conv1D layers became nn.Linear call_modules (weight = the transposed view of the HF "
                         f"[in, out] weight, same storage): {conv1d[:3]}{' ...' if len(conv1d) > 3 else ''}")
        notes.extend(kept.lines.values())
        notes.extend(held)
    return out
