"""quantize_transform_pass: MASE's config-driven quantization of a ForgeGraph (simulation).

* nn.Linear / Conv1d / Conv2d / LayerNorm call_module nodes get their module swapped (through the
  shared injection engine) for the quantized layer of ``modules.py``.
* Attention (``scaled_dot_product_attention`` as a function or fxforge module) becomes a
  :class:`QuantizedSDPA` call_module that quantizes the matmuls and softmax inside it
  (``by: type`` takes the ``matmul`` and ``softmax`` entries; see ``attention.py``).
* Other ops (matmul, bmm, einsum, add, sub, mul, relu, gelu, softmax, functional linear/conv/
  layer_norm, FFTs) get :class:`Quantize` call_module nodes inserted on their floating-point tensor
  inputs and on their output. Complex tensors (the AFNO FFT path) are quantized as real and
  imaginary parts. An input that is a parameter, or a view / slice / split of one (``params.py``:
  nn.MultiheadAttention's ``in_proj_weight``), is quantized as a weight, with a scale from itself.

* A module that wraps a layer (``fxforge_wraps``, e.g. LoRA's ``LoraLinear``) gets the wrapped layer
  quantized; the wrapper's own part (the LoRA adapter) stays float and is listed in
  ``info.float_adapters`` (fusing the adapter later keeps the layer quantized).

Each quantized node gets a :class:`QuantizationRecord` in its software metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import dtype_from_name, get_meta, has_meta
from ..base import PassArgsError, forge_pass
from ..contract import NumericalContract, PassInfo
from ..propagate import init_node
from ..rewrite import GraphRewrite, inject_modules
from ..select import node_identity
from .attention import QuantizedSDPA
from .config import FFT_OPS, QUANTIZABLE_OPS, OpQuantConfig, QuantizeConfig
from .layer_swap import SDPA, LayerSwap, layer_quantizer_paths, plan_layer_swap, sdpa_configs
from .params import from_parameter
from .quantizer import Quantize
from .records import QuantizationRecord
from .state import quantizers as all_quantizers

__all__ = ["quantize_transform_pass", "QuantizeInfo", "CONTAINER"]

CONTAINER = "fxforge_quant"  # submodule holding the quantizers inserted around function nodes
_CALLS = ("call_module", "call_function", "call_method")

# op -> [(arg index, role, channel_axis, block_axis)] for function-like nodes.
_ARG_ROLES: dict[str, list[tuple[int, str, int, int]]] = {
    "linear": [(0, "data_in", -1, -1), (1, "weight", 0, -1), (2, "bias", 0, -1)],
    "conv1d": [(0, "data_in", 1, 1), (1, "weight", 0, 1), (2, "bias", 0, -1)],
    "conv2d": [(0, "data_in", 1, 1), (1, "weight", 0, 1), (2, "bias", 0, -1)],
    "matmul": [(0, "data_in", -1, -1), (1, "weight", -1, -2)],
    "bmm": [(0, "data_in", -1, -1), (1, "weight", -1, -2)],
    "layer_norm": [(0, "data_in", -1, -1), (2, "weight", -1, -1), (3, "bias", -1, -1)],
    "embedding": [(1, "weight", 0, -1)],
    **{op: [(0, "data_in", -1, -1)] for op in ("relu", "gelu", "softmax", *FFT_OPS)},
}


def _einsum_roles(node: fx.Node) -> list[tuple[int, str, int, int]]:
    """First operand data_in, the others weight; blocks run along each operand's contracted index."""
    eq, operands = node.args[0], node.args[1:]
    if not isinstance(eq, str) or any(isinstance(o, list | tuple) for o in operands):
        return []
    eq = eq.replace(" ", "")
    inputs, out = (eq.split("->") + [""])[:2] if "->" in eq else (eq, None)
    terms = inputs.split(",")
    contracted = set("".join(terms)) - set(out) if out is not None and "..." not in eq else set()
    roles = []
    for i, term in enumerate(terms[: len(operands)]):
        hits = [j for j, c in enumerate(term) if c in contracted]
        block = hits[-1] - len(term) if hits else -1
        roles.append((i + 1, "data_in" if i == 0 else "weight", -1, block))
    return roles


def _arg_roles(node: fx.Node, op: str) -> list[tuple[int, str, int, int]]:
    if op in ("matmul", "bmm") and len(node.args) >= 2 and from_parameter(node.args[0]) \
            and not from_parameter(node.args[1]):  # W @ x: the parameter is the weight (per row), x the input
        return [(0, "weight", -2, -1), (1, "data_in", -1, -2)]
    if op in ("add", "sub", "mul"):
        return [(i, "data_in", -1, -1) for i in range(min(len(node.args), 2))]
    if op == "einsum":
        return _einsum_roles(node)
    return _ARG_ROLES.get(op, [])


def _dtype(node: Any) -> torch.dtype | None:
    """The node's result dtype when capture or metadata recorded it."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if has_meta(node):
        res = get_meta(node).common.results.get("data_out_0")
        if res is not None and res.dtype:
            return dtype_from_name(res.dtype)
    return None


def _floating(node: Any) -> bool:
    """May this value be a floating/complex tensor? (unknown dtype: yes; Quantize skips others)."""
    if not isinstance(node, fx.Node):
        return False
    dt = _dtype(node)
    return dt is None or dt.is_floating_point or dt.is_complex


class _Rewriter:
    """Applies the per-node decisions to the GraphModule through the rewrite engine."""

    def __init__(self, graph: ForgeGraph, rw: GraphRewrite) -> None:
        self.mg = graph
        self.gm = graph.model
        self.rw = rw
        self.swaps: dict[str, LayerSwap] = {}

    @property
    def inserted(self) -> int:
        return self.rw.inserted

    def _new_quant_node(self, path: str, q: Quantize, arg: fx.Node, like: fx.Node, *, before: fx.Node | None = None,
                        after: fx.Node | None = None) -> fx.Node:
        new = self.rw.call_module(path, q, (arg,), before=before, after=after)
        if "val" in like.meta:
            new.meta["val"] = like.meta["val"]
        return new

    def wrap_function(self, node: fx.Node, op: str, cfg: OpQuantConfig) -> dict[str, str]:
        """Insert quantizers on the node's float inputs (by role) and on its output."""
        done: dict[str, str] = {}
        for index, role, channel, block in _arg_roles(node, op):
            spec = cfg.role(role)
            if spec is None or index >= len(node.args) or not _floating(node.args[index]):
                continue
            arg = node.args[index]
            assert isinstance(arg, fx.Node)
            key = f"{role}_{index}"
            path = f"{CONTAINER}.{node.name}__{key}"
            # a parameter (or a view / slice of one: MultiheadAttention's in_proj_weight) is a weight wherever it
            # enters: scale from its own values on every call, never a calibrated one
            q = Quantize(spec, role, is_param=from_parameter(arg), channel_axis=channel, block_axis=block)
            new = self._new_quant_node(path, q, arg, arg, before=node)
            self.rw.set_arg(node, index, new)
            done[key] = path
        spec = cfg.role("data_out")
        if spec is not None and _floating(node):
            path = f"{CONTAINER}.{node.name}__data_out"
            block = 1 if op in ("conv1d", "conv2d") else -1
            q = Quantize(spec, "data_out", channel_axis=block, block_axis=block)
            new = self._new_quant_node(path, q, node, node, after=node)
            self.rw.redirect_users(node, new, keep=lambda user: user is new)
            done["data_out"] = path
        return done

    def sdpa_function(self, node: fx.Node, mm: OpQuantConfig | None, sm: OpQuantConfig | None) -> fx.Node:
        """Replace an SDPA call_function by a QuantizedSDPA call_module (same inputs)."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        module = QuantizedSDPA(_constant(node, "dropout_p", bound.get("dropout_p")) or 0.0,
                               bool(bound.get("is_causal", False)), _constant(node, "scale", bound.get("scale")),
                               bool(bound.get("enable_gqa", False)), mm, sm)
        # The node itself becomes the call_module: name, records and users stay (reports and
        # baselines match nodes by name).
        return self.rw.replace(node, "call_module", f"{CONTAINER}.{node.name}",
                               (bound["query"], bound["key"], bound["value"], bound.get("attn_mask")), module=module)


def _constant(node: fx.Node, key: str, value: Any) -> float | None:
    """An SDPA argument a quantized attention holds as a constant (dropout_p, scale): a number or None;
    ValueError naming the node and the way out for one computed at run time."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    computed = f"node {value.name!r}" if isinstance(value, fx.Node) else type(value).__name__
    raise ValueError(f"node {node.name!r} (scaled_dot_product_attention): its {key!r} is computed at run time "
                     f"({computed}), and a quantized attention holds it as a constant; exclude it with "
                     f"by='name'/'regex' or a name entry with name None, or capture with a constant {key}")


def _record(node: fx.Node, op: str, fmt: str, config: dict[str, Any], rule: str | None,
            quantizers: Mapping[str, str]) -> None:
    get_meta(node).software.set(QuantizationRecord(op=op, format=fmt, config=config, rule=rule,
                                                   quantizers=dict(quantizers)))


@dataclass(frozen=True)
class QuantizeInfo(PassInfo):
    """quantized_nodes: nodes quantized; by_op: per canonical op; inserted_quantizer_nodes: Quantize
    call_module nodes inserted around function nodes; quantizers: Quantize modules in the graph;
    float_adapters: wrappers (LoRA) whose wrapped layer was quantized while their adapter stays float."""

    quantized_nodes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    inserted_quantizer_nodes: int = 0
    quantizers: int = 0
    float_adapters: list[str] = field(default_factory=list)


@forge_pass("transform", QuantizeConfig, info=QuantizeInfo, forbids=("quantized", "activation-checkpointed",
                                                                                "pipeline-stages"),
            ensures=("metadata", "quantized"),
            contract=NumericalContract("bounded", note="simulated quantization: error measured (SQNR) and reported"))
def quantize_transform_pass(graph: ForgeGraph, args: QuantizeConfig) -> tuple[ForgeGraph, QuantizeInfo]:
    """Quantize ``graph`` in place with a MASE config (``by``/``default``/op or name keys).

    The config is validated first (unknown format, key, op type or regex: PassArgsError listing the
    allowed values) and never mutated. Quantize once, on the float graph (``ForgeGraph.copy()`` keeps
    a float version); nodes without metadata get it initialised.
    """
    if args.default is None and all(c is None for _, c in args.rules):
        raise PassArgsError("quantize_transform_pass: the config selects no format (the default and every "
                            "entry have name None); give e.g. {'linear': {'config': {'name': 'integer', ...}}}")
    gm = graph.model
    for node in gm.graph.nodes:
        if not has_meta(node):
            init_node(node, gm)
    used_keys: set[str] = set()
    by_op: dict[str, int] = {}
    pending: list[tuple[str, str]] = []  # (node name, module path) of swapped layers, recorded after the swap
    float_adapters: list[str] = []

    with GraphRewrite(gm) as grw:
        rw = _Rewriter(graph, grw)
        for node in list(gm.graph.nodes):
            if node.op not in _CALLS:
                continue
            name, module, op = node_identity(node, gm)
            if node.op == "call_module" and module is not None:
                handled, rules, swap = plan_layer_swap(name, module, op, args, f"node {node.name!r} ({name})")
                used_keys.update(rules)
                if swap is not None:
                    rw.swaps[name] = swap
                    pending.append((node.name, name))
                    by_op[swap.op] = by_op.get(swap.op, 0) + 1
                    if swap.wrapped is not None:
                        float_adapters.append(name)
                if handled:
                    continue
            if op == SDPA:
                rules, rule, mm, sm = sdpa_configs(args, name, module)
                used_keys.update(rules)
                first = mm if mm is not None else sm
                if first is None:
                    continue
                if node.op != "call_function":
                    raise ValueError(f"node {node.name!r}: cannot quantize attention implemented by "
                                     f"{type(module).__name__}")
                config = {"matmul": mm.to_json() if mm else None, "softmax": sm.to_json() if sm else None}
                new = rw.sdpa_function(node, mm, sm)
                sdpa = gm.get_submodule(str(new.target))
                assert isinstance(sdpa, QuantizedSDPA)
                slots = {s: f"{new.target}.{s}_quantizer" for s in sdpa.quantizers()}
                _record(new, op, first.format, config, rule, slots)
                by_op[op] = by_op.get(op, 0) + 1
                continue
            if op not in QUANTIZABLE_OPS:
                continue
            rule, cfg = args.rule_for(name, op, module)
            if rule is not None:
                used_keys.add(rule)
            if cfg is None:
                continue
            quantizers = rw.wrap_function(node, op, cfg)
            if quantizers:
                _record(node, op, cfg.format, cfg.to_json(), rule, quantizers)
                by_op[op] = by_op.get(op, 0) + 1

    if args.by != "type":
        unused = [k for k, _ in args.rules if k not in used_keys]
        if unused:
            sample = [node_identity(n, gm)[0] for n in gm.graph.nodes if n.op in _CALLS
                      and node_identity(n, gm)[2] in (*QUANTIZABLE_OPS, SDPA)][:8]
            raise PassArgsError(f"quantize_transform_pass: by={args.by!r} key(s) {unused} matched no quantizable "
                                f"node; quantizable nodes include {sample}")
    if rw.swaps:
        inject_modules(gm, {"predicate": lambda n, m, op: n in rw.swaps}, None,
                       lambda n, m: rw.swaps[n].build(m), what="quantizable layer")
    nodes = {n.name: n for n in gm.graph.nodes}
    for node_name, path in pending:
        swap = rw.swaps[path]
        paths = layer_quantizer_paths(path, swap, gm.get_submodule(path))
        _record(nodes[node_name], swap.op, swap.format, swap.config, swap.rule, paths)
    return graph, QuantizeInfo(quantized_nodes=sum(by_op.values()), by_op=by_op,
                               inserted_quantizer_nodes=rw.inserted, quantizers=len(all_quantizers(gm)),
                               float_adapters=float_adapters)
