"""attention_swap_transform_pass: multi-head attention -> grouped-query attention (MASE's ``mgqa`` swap).

For every scaled-dot-product attention of the graph the pass follows its key and value back to the Linear that
projects them (through reshapes, rotary embeddings, transposes, and a split / chunk / slice of a fused qkv
projection), checks the heads are laid out head-major (a reshape to ``(..., heads, head_dim)``), and swaps the
projection for a :class:`GroupedKVLinear` holding ``kv_heads`` heads, each the mean of the heads of its group.
Rotary embeddings act on each head alike, so repeating the pooled heads at the projection computes exactly the
grouped-query attention that pooled heads define. The cost is reported: the relative change of the projection
weights per layer and, over ``data`` (or the graph's example inputs), the relative error and SQNR of the
outputs. A short fine-tune recovers it (examples/attention_swap.py).

MASE also converts attention to multi-head latent attention (MLA); fxforge does not. MASE's GPT-2 path builds a
DeepSeek MLA module from truncated SVD factors of the key/value weights, padded or cropped to the module's fixed
rank and with its kv_norm filled at random, so it does not reproduce the source attention; its Llama path rewrites
HF's attention modules in place (latent up-projections of the GQA heads). MLA's gain is a compressed KV cache,
which fxforge's captured graphs (no cache) do not hold; grouped-query attention is exact to its definition here.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import dtype_from_name, get_meta, has_meta
from ..base import forge_pass
from ..batching import evaluating, iter_batches, run_batch
from ..contract import NumericalContract, PassInfo
from ..metrics import compare_outputs, signal_noise_power
from ..rewrite import GraphRewrite
from ..select import node_identity
from .grouped_kv import GroupedKVLinear, Segment

__all__ = ["AttentionSwapArgs", "AttentionSwapInfo", "GqaLayer", "attention_swap_transform_pass"]

SDPA = "scaled_dot_product_attention"
_RESHAPES = ("view", "reshape", "unflatten", "_unsafe_view")


@dataclass(frozen=True)
class AttentionSwapArgs:
    """kv_heads: key/value heads each converted attention keeps (must divide its heads); layers: attention layers
    to convert (a layer's name, e.g. ``"model.layers.0.self_attn"``, or a dotted suffix of it; None = every one);
    data: batches to measure the output cost on (default: the graph's example inputs); num_batches: at most so
    many of them."""

    kv_heads: int = field(metadata={"range": (1, 2**16)})
    layers: tuple[str, ...] | None = None
    data: Any = None
    num_batches: int = 4


@dataclass(frozen=True)
class GqaLayer:
    """One converted attention: its heads, the key/value heads kept, the projections (key, value) and the
    relative Frobenius change of their pooled weights."""

    heads: int
    kv_heads: int
    key: str
    value: str
    weight_error: float


@dataclass(frozen=True)
class AttentionSwapInfo(PassInfo):
    """layers: converted attention layers by name; parameters_removed: projection parameters dropped;
    relative_output_error: ||y' - y|| / ||y|| over the measured batches (None when there were none);
    output_sqnr_db: the same as an SQNR; max_abs_error: largest output difference."""

    layers: dict[str, GqaLayer] = field(default_factory=dict)
    parameters_removed: int = 0
    relative_output_error: float | None = None
    output_sqnr_db: float | None = None
    max_abs_error: float | None = None


def _result(node: fx.Node) -> tuple[tuple[int, ...] | None, bool]:
    """(shape, is a floating tensor) of the node's first result, from its metadata."""
    if not has_meta(node):
        return None, False
    res = get_meta(node).common.results.get("data_out_0")
    if res is None or res.shape is None or not res.dtype:
        return None, False
    return tuple(res.shape), dtype_from_name(res.dtype).is_floating_point


def _trace_projection(start: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, list[fx.Node]]:
    """The call_module node that produces ``start``'s tensor data, and the path from it to ``start``.

    Walks back through floating-point tensor inputs only (sizes and dtypes are not data); ValueError when no
    single module is found (e.g. the key is computed by functions only, or from two layers)."""
    succ: dict[fx.Node, fx.Node | None] = {start: None}
    queue, found = deque([start]), []
    while queue:
        node = queue.popleft()
        if node.op == "call_module" and node is not start:
            found.append(node)
            continue
        for arg in node.all_input_nodes:
            if arg not in succ and arg.op not in ("placeholder", "get_attr") and _result(arg)[1]:
                succ[arg] = node
                queue.append(arg)
    modules = {str(n.target) for n in found}
    if len(modules) != 1:
        raise ValueError(f"its {start.name!r} comes from {sorted(modules) or 'no layer'}, not from one projection")
    path, node_or_none = [found[0]], succ[found[0]]
    while node_or_none is not None:
        path.append(node_or_none)
        node_or_none = succ[node_or_none]
    return found[0], path


def _int(value: Any, default: int = 0) -> int:
    """An int argument of a node (``default`` when absent); ValueError for anything computed at run time."""
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"a size or index of the projection's split is {value!r}, not a constant")


def _segment(path: list[fx.Node], gm: fx.GraphModule, width: int) -> tuple[int, int, int]:
    """(start column, width, index in ``path`` of the first node after the segment) of the projection output the
    path reads: all of it, or one part of a split / chunk (+ getitem), slice or narrow along the last dim."""
    node = path[1]
    op = node_identity(node, gm)[2]
    shape = _result(path[0])[0]
    rank = len(shape) if shape else 0
    args, kwargs = node.args, node.kwargs
    if op in ("split", "split_with_sizes", "chunk") and len(path) > 2 and path[2].target is operator.getitem:
        dim = _int(args[2] if len(args) > 2 else kwargs.get("dim"), 0)
        if op == "chunk":
            step = math.ceil(width / _int(args[1]))
            sizes = [min(step, width - i) for i in range(0, width, step)]
        else:
            size = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
            sizes = [_int(s) for s in size] if isinstance(size, list | tuple) else \
                [min(_int(size), width - i) for i in range(0, width, _int(size))]
        index = _int(path[2].args[1])
        if dim % max(rank, 1) != rank - 1:
            raise ValueError(f"{node.name!r} splits the projection along dim {dim}, not its features")
        return sum(sizes[:index]), sizes[index], 3
    if op in ("slice", "narrow"):
        dim = _int(args[1] if len(args) > 1 else kwargs.get("dim"), 0)
        if dim % max(rank, 1) != rank - 1:
            raise ValueError(f"{node.name!r} slices the projection along dim {dim}, not its features")
        start = _int(args[2] if len(args) > 2 else kwargs.get("start"), 0)
        if op == "narrow":
            return start, _int(args[3]), 2
        end = min(_int(args[3] if len(args) > 3 else kwargs.get("end"), width), width)
        if _int(args[4] if len(args) > 4 else kwargs.get("step"), 1) != 1:
            raise ValueError(f"{node.name!r} slices the projection with a step")
        return start, end - start, 2
    return 0, width, 1


def _heads(what: str, start: fx.Node, gm: fx.GraphModule, head_dim: int) -> tuple[str, Segment]:
    """(projection path, segment) of the key or value ``start`` of an attention."""
    proj, path = _trace_projection(start, gm)
    module = gm.get_submodule(str(proj.target))
    if type(module) is not nn.Linear:
        raise ValueError(f"its {what} comes from {proj.target!r}, a {type(module).__name__}, not an nn.Linear "
                         "(swap attention before LoRA, quantization or pruning)")
    first, width, after = _segment(path, gm, module.out_features)
    heads = width // head_dim
    reshape = path[after] if after < len(path) else None
    shape = _result(reshape)[0] if reshape is not None else None
    if reshape is None or node_identity(reshape, gm)[2] not in _RESHAPES or width % head_dim or \
            shape is None or tuple(shape[-2:]) != (heads, head_dim):
        raise ValueError(f"the {what} projection {proj.target!r} is not reshaped to (..., heads, {head_dim}) "
                         "head-major before attention, so its heads cannot be located")
    return str(proj.target), (first, heads, 0, head_dim)


def _layer_name(key: str, value: str) -> str:
    """The attention's name: the module holding its key and value projections (their common dotted prefix)."""
    if key == value:
        return key.rpartition(".")[0] or key
    a, b = key.split("."), value.split(".")
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return ".".join(a[:n]) or key


def _selected(name: str, node: fx.Node, layers: tuple[str, ...] | None) -> bool:
    return layers is None or any(s in (name, node.name) or name.endswith("." + s) for s in layers)


def _weight_error(old: nn.Linear, new: GroupedKVLinear) -> float:
    """||W' - W|| / ||W|| of the projection's effective weight (bias included as a column)."""
    with torch.no_grad():
        probe = torch.cat([torch.zeros(1, old.in_features), torch.eye(old.in_features)]).to(old.weight)
        eff, ref = new(probe), old(probe)
    return float(torch.linalg.norm(eff - ref) / torch.linalg.norm(ref))


def _outputs(graph: ForgeGraph, args: AttentionSwapArgs) -> list[Any]:
    if args.data is None and graph.example_inputs is None:
        return []
    with evaluating(graph.model):
        return [run_batch(graph.model, b) for b in iter_batches(graph, args.data, args.num_batches)]


def _history(graph: ForgeGraph) -> str:
    names = [r.name for r in graph.history]
    return f" (passes applied to this graph: {names})" if names else ""


@forge_pass("transform", AttentionSwapArgs, info=AttentionSwapInfo, requires=("shapes",),
            forbids=("quantized", "lora", "pruned", "activation-checkpointed", "pipeline-stages"),
            contract=NumericalContract("bounded", note="key/value heads mean-pooled: error measured and reported"))
def attention_swap_transform_pass(graph: ForgeGraph, args: AttentionSwapArgs
                                  ) -> tuple[ForgeGraph, AttentionSwapInfo]:
    """Convert each selected attention to grouped-query attention with ``kv_heads`` key/value heads; a layer whose
    heads ``kv_heads`` does not divide is refused by name. Layers already at ``kv_heads`` are left as they are."""
    gm = graph.model
    plans: dict[str, list[Segment]] = {}
    layers: dict[str, GqaLayer] = {}
    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function") or node_identity(node, gm)[2] != SDPA:
            continue
        key_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("key")
        value_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
        if not isinstance(key_arg, fx.Node) or not isinstance(value_arg, fx.Node):
            raise ValueError(f"attention {node.name!r}: its key and value are not graph values")
        key_shape = _result(key_arg)[0]
        if key_shape is None or len(key_shape) < 3:
            raise ValueError(f"attention {node.name!r}: its key's shape is unknown{_history(graph)}")
        try:
            (kpath, kseg), (vpath, vseg) = (_heads(w, a, gm, key_shape[-1])
                                            for w, a in (("key", key_arg), ("value", value_arg)))
        except ValueError as exc:
            raise ValueError(f"attention {node.name!r}: {exc}{_history(graph)}") from None
        name = _layer_name(kpath, vpath)
        found.append(name)
        if not _selected(name, node, args.layers):
            continue
        for what, seg in (("key", kseg), ("value", vseg)):
            if seg[1] % args.kv_heads:
                divisors = [d for d in range(1, seg[1] + 1) if seg[1] % d == 0]
                raise ValueError(f"layer {name!r} has {seg[1]} {what} heads, which kv_heads={args.kv_heads} does "
                                 f"not divide; choose one of {divisors}")
        if kseg[1] == args.kv_heads and vseg[1] == args.kv_heads:
            continue
        for path, seg in ((kpath, kseg), (vpath, vseg)):
            plans.setdefault(path, []).append((seg[0], seg[1], args.kv_heads, seg[3]))
        layers[name] = GqaLayer(kseg[1], args.kv_heads, kpath, vpath, 0.0)
    if args.layers is not None:
        unknown = [s for s in args.layers if not any(f == s or f.endswith("." + s) for f in found)]
        if unknown:
            raise ValueError(f"layers {unknown} name no attention layer; the graph's attention layers: {found}")
    before = _outputs(graph, args) if plans else []
    removed = 0
    errors: dict[str, float] = {}
    with GraphRewrite(gm) as rw:
        for path, segments in plans.items():
            old = gm.get_submodule(path)
            assert isinstance(old, nn.Linear)
            new = GroupedKVLinear.from_linear(old, tuple(segments))
            removed += sum(p.numel() for p in old.parameters()) - sum(p.numel() for p in new.parameters())
            errors[path] = _weight_error(old, new)
            rw.set_module(path, new)
    layers = {n: GqaLayer(g.heads, g.kv_heads, g.key, g.value, max(errors[g.key], errors[g.value]))
              for n, g in layers.items()}
    after = _outputs(graph, args) if before else []
    if not before:
        return graph, AttentionSwapInfo(layers=layers, parameters_removed=removed)
    signal, noise = signal_noise_power(before, after)
    diff = compare_outputs(before, after)
    return graph, AttentionSwapInfo(layers=layers, parameters_removed=removed,
                                    relative_output_error=math.sqrt(noise / signal) if signal else None,
                                    output_sqnr_db=diff.sqnr_db, max_abs_error=diff.max_abs)
