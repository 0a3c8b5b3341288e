"""Normalisation steps for what torch.export makes of HF decoders: higher-order regions and HF's Conv1D.

* ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` regions (a ``torch.no_grad()`` rotary embedding,
  a disabled autocast block) are subgraph modules a checkpoint cannot name. They are inlined into the main
  graph: a no-grad region's outputs are detached (exactly what no_grad gives the rest of the graph), a
  disabled autocast region is plain code. An *enabled* autocast region is kept (its casts happen at
  dispatch, so inlining would drop them) and the capture notes say a checkpoint cannot hold it.
* HF's ``Conv1D`` (GPT-2) computes ``addmm(bias, x, weight)`` with the weight stored ``[in, out]``. Its
  ``addmm`` becomes a call to an ``nn.Linear`` at the Conv1D's path whose weight is the transposed view of
  the HF weight (same storage, PEFT's ``fan_in_fan_out`` layout seen as a linear), so LoRA, quantization and
  the selector's ``linear`` type treat it as the linear layer it is.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

aten = torch.ops.aten
_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
REGION_OPS = frozenset({_SET_GRAD, _AUTOCAST})


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for transformers' ``pytorch_utils.Conv1D`` (or a subclass keeping its forward)."""
    base = next((c for c in type(module).__mro__ if issubclass(c, nn.Module)
                 and c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils"), None)
    return base is not None and type(module).forward is base.forward


def linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    """An nn.Linear computing exactly what HF's Conv1D computes, sharing its storage (weight transposed)."""
    weight, bias = conv.weight, conv.bias
    if not isinstance(weight, torch.Tensor) or not (bias is None or isinstance(bias, nn.Parameter)):
        raise TypeError(f"{type(conv).__name__} is not an HF Conv1D: its weight is not a tensor or its bias "
                        "not a parameter")
    linear = nn.Linear(1, 1, bias=False, device="meta")
    linear.in_features, linear.out_features = int(weight.shape[0]), int(weight.shape[1])
    linear.weight = nn.Parameter(weight.detach().t(), requires_grad=weight.requires_grad)
    linear.bias = bias
    linear.train(conv.training)
    return linear


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _inline_region(gm: fx.GraphModule, node: fx.Node, sub_index: int, detach: bool) -> None:
    """Copy the region's subgraph in place of ``node``; its getitem users read the copied outputs."""
    sub_node = node.args[sub_index]
    assert isinstance(sub_node, fx.Node) and sub_node.op == "get_attr"
    sub = _attr(gm, str(sub_node.target))
    operands = list(node.args[sub_index + 1:])
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands))
    outputs: Any = None
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                outputs = fx.map_arg(sn.args[0], lambda a: env[a])
            elif sn.op == "get_attr":
                name = _fresh_attr(gm, str(sn.target).replace(".", "_"))
                value = _attr(sub, str(sn.target))
                if isinstance(value, nn.Module):
                    gm.add_submodule(name, value)
                else:
                    setattr(gm, name, value)
                env[sn] = graph.get_attr(name)
                env[sn].meta.update(sn.meta)
            else:
                env[sn] = graph.node_copy(sn, lambda a: env[a])
                for key in ("nn_module_stack", "stack_trace"):
                    if key not in env[sn].meta and key in node.meta:
                        env[sn].meta[key] = node.meta[key]
        outs = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        if detach:
            detached = []
            for out in outs:
                if isinstance(out, fx.Node):
                    d = graph.call_function(aten.detach.default, (out,))
                    d.meta.update({k: v for k, v in out.meta.items() if k in ("val", "nn_module_stack")})
                    out = d
                detached.append(out)
            outs = detached
    for user in list(node.users):
        index = user.args[1] if len(user.args) == 2 else None
        if not isinstance(index, int):
            raise ValueError(f"inlining region {node.name!r}: its user {user.name!r} is not an indexed read of "
                             "its outputs")
        user.replace_all_uses_with(outs[index])
        graph.erase_node(user)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)


def inline_regions(gm: fx.GraphModule, notes: list[str]) -> None:
    """Inline every set-grad and disabled-autocast region of ``gm`` (nested ones too); see module docstring."""
    done: dict[str, int] = {}
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in REGION_OPS:
                continue
            if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
                notes.append(f"kept region {node.name!r}: its outputs are used other than by index")
                continue
            if node.target is _SET_GRAD:
                enabled = bool(node.args[0])
                _inline_region(gm, node, 1, detach=not enabled)
                key = "no_grad regions inlined (outputs detached)" if not enabled else "enable_grad regions inlined"
            elif not bool(node.args[2]):
                _inline_region(gm, node, 4, detach=False)
                key = "disabled autocast regions inlined"
            else:
                notes.append(f"kept enabled autocast region {node.name!r} ({node.args[0]}, {node.args[1]}): "
                             "inlining would drop its casts; a checkpoint cannot hold this graph")
                continue
            done[key] = done.get(key, 0) + 1
            changed = True
            break
    notes.extend(f"{k}: {v}" for k, v in done.items())


def conv1d_linear(gm: fx.GraphModule, node: fx.Node, owner: tuple[str, nn.Module] | None) -> nn.Linear | None:
    """The nn.Linear replacing an ``addmm`` made by an HF Conv1D (None when the node is not exactly that)."""
    if owner is None or not is_hf_conv1d(owner[1]) or node.kwargs or len(node.args) != 3:
        return None
    conv = owner[1]
    bias_node, _, weight_node = node.args
    if conv._forward_hooks or conv._forward_pre_hooks or conv.bias is None:
        return None
    for arg, tensor in ((weight_node, conv.weight), (bias_node, conv.bias)):
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr" and _attr(gm, str(arg.target)) is tensor):
            return None
        if len(arg.users) != 1 or sum(1 for n in gm.graph.nodes if n.op == "get_attr" and n.target == arg.target) > 1:
            return None  # the weight is read elsewhere too (tied): keep the ATen call
    return linear_from_conv1d(conv)
