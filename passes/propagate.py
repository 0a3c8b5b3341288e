"""Metadata propagation, one implementation for the metadata passes and the rewrite engine.

``fresh_common`` says what a node is (kind, canonical op, module type); ``record_node`` writes what
flows in and out of it; :func:`propagate_graph` runs the whole graph once (torch.fx Interpreter) and
:func:`derive_nodes` re-derives only some nodes from the metadata recorded on their inputs (fake
tensors of the recorded shapes, real zeros when an op cannot run on fake tensors), so a rewrite's new
nodes get exactly what a fresh metadata pass would record without running the model.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx._pytree import tree_flatten_spec
from torch.fx.graph import _PyTreeCodeGen

from ..graph.inputs import ExampleInputs
from ..graph.ir import classify, module_type_name
from ..graph.metadata import CommonMeta, NodeMeta, ValueMeta, dtype_from_name, get_meta, has_meta, set_meta
from .batching import evaluating

__all__ = ["fresh_common", "record_node", "propagate_graph", "derive_nodes", "flat_inputs", "Underivable"]


class Underivable(ValueError):
    """A node's inputs carry no recorded values to derive its metadata from."""


def fresh_common(node: fx.Node, gm: fx.GraphModule) -> CommonMeta:
    """A node's identity as init_metadata_analysis_pass records it (no values yet)."""
    kind, op = classify(node, gm)
    module_type = module_type_name(gm.get_submodule(str(node.target))) if node.op == "call_module" else None
    return CommonMeta(kind=kind, op=op, module_type=module_type)


def init_node(node: fx.Node, gm: fx.GraphModule) -> None:
    """Give ``node`` fresh metadata (software/hardware sections empty)."""
    set_meta(node, NodeMeta(common=fresh_common(node, gm)))


def record_node(node: fx.Node, gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> None:
    """Write the values flowing into and out of ``node`` (and its module's own parameters) into its metadata."""
    meta = get_meta(node).common
    meta.args = {}
    if node.op not in ("placeholder", "get_attr", "output"):
        for i, a in enumerate(args):
            if isinstance(a, list | tuple) and any(isinstance(x, torch.Tensor) for x in a):
                for j, x in enumerate(a):
                    meta.args[f"data_in_{i}_{j}"] = ValueMeta.of(x)
            else:
                meta.args[f"data_in_{i}"] = ValueMeta.of(a)
        for key, value in kwargs.items():
            meta.args[key] = ValueMeta.of(value)
    if node.op == "call_module":
        for pname, param in gm.get_submodule(str(node.target)).named_parameters(recurse=False):
            meta.args[pname] = ValueMeta.of(param)
    if node.op == "output":
        values = result if isinstance(result, list | tuple) else (result,)
        meta.args = {f"data_in_{i}": ValueMeta.of(v) for i, v in enumerate(values)}
        meta.results = {}
    elif isinstance(result, list | tuple):
        meta.results = {f"data_out_{i}": ValueMeta.of(v) for i, v in enumerate(result)}
    else:
        meta.results = {"data_out_0": ValueMeta.of(result)}


class _Recorder(fx.Interpreter):
    """Runs the graph once and records every node's values."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.gm = gm  # Interpreter.module is typed as any nn.Module; record_node reads a GraphModule

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n) if n.op not in ("placeholder", "get_attr") else ((), {})
        record_node(n, self.gm, args, kwargs, result)
        return result


def _bind(sig: inspect.Signature, example: ExampleInputs) -> inspect.BoundArguments:
    """Bind inputs to the graph's inputs; a mismatch names what the graph takes and how to capture fewer."""
    try:
        return sig.bind(*example.args, **example.kwargs)
    except TypeError as exc:
        given = [f"{len(example.args)} positional"] * bool(example.args) + list(example.kwargs)
        raise ValueError(f"the inputs do not fit the graph ({exc}): it takes {list(sig.parameters)}, given {given}; "
                         "give every input, or capture a HuggingFace model with hf_input_names=[...] naming only the "
                         "inputs you pass") from None


def flat_inputs(gm: fx.GraphModule, example: ExampleInputs) -> list[Any]:
    """The placeholder values for calling ``gm(*args, **kwargs)``, in placeholder order."""
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.in_spec is not None:
        info = codegen.pytree_info
        sig = inspect.Signature([
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in info.orig_args
        ])
        bound = _bind(sig, example)
        values = [bound.arguments[n] for n in info.orig_args]
        spec = info.in_spec
        if (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple
                and spec.child(1).type is dict):
            count = spec.child(0).num_children
            kwargs = dict(zip(spec.child(1).context, values[count:]))
            return list(tree_flatten_spec((values[:count], kwargs), spec))
        return list(tree_flatten_spec(values, spec))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [inspect.Parameter(str(p.target).lstrip("*"), inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                default=p.args[0] if p.args else inspect.Parameter.empty)
              for p in placeholders]
    bound = _bind(inspect.Signature(params), example)
    bound.apply_defaults()
    return list(bound.arguments.values())


def propagate_graph(gm: fx.GraphModule, example: ExampleInputs) -> None:
    """Initialise missing metadata, then run the graph once (eval, no_grad) recording every node's values."""
    for node in gm.graph.nodes:
        if not has_meta(node):
            init_node(node, gm)
    flat = flat_inputs(gm, example)
    with evaluating(gm):
        _Recorder(gm).run(*flat)


# -- local derivation -------------------------------------------------------------------------------
def _value(meta: ValueMeta, make: Any) -> Any:
    if meta.type == "tensor":
        assert meta.shape is not None and meta.dtype is not None
        value = make(meta.shape, dtype_from_name(meta.dtype))
        # as recorded: a value computed from parameters carries requires_grad into what is derived from it
        return value.requires_grad_(True) if meta.requires_grad and value.is_floating_point() else value
    if meta.type == "none":
        return None
    if meta.type == "scalar" and not isinstance(meta.value, str):
        return meta.value
    if meta.type == "dtype" and isinstance(meta.value, str):
        return dtype_from_name(meta.value)
    raise Underivable(f"cannot rebuild a {meta.type} value ({meta.value!r}) from metadata")


def _node_value(node: fx.Node, gm: fx.GraphModule, make: Any) -> Any:
    if node.op == "get_attr":
        return _fetch(gm, str(node.target))
    if not has_meta(node) or not get_meta(node).common.results:
        raise Underivable(f"input {node.name!r} has no recorded result")
    results = get_meta(node).common.results
    values = [_value(results[k], make) for k in sorted(results, key=lambda k: int(k.rsplit("_", 1)[1]))]
    return values[0] if len(values) == 1 else tuple(values)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def has_values(gm: fx.GraphModule) -> bool:
    """Whether the graph's metadata records values (a value-recording pass has run on it)."""
    return any(has_meta(n) and get_meta(n).common.results for n in gm.graph.nodes)


def _fake(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


class _OneNode(fx.Interpreter):
    """Runs one node; a call_module runs on a copy of its module, so nothing the run caches (packed
    kernels, quantized weights) or mutates leaks into the graph, and fake tensors never stick."""

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with unset_fake_temporarily():  # a real copy: deep-copying real parameters under fake mode fails noisily
            module = copy.deepcopy(self.fetch_attr(str(target)))
        return module(*args, **kwargs)


def _run_one(gm: fx.GraphModule, node: fx.Node, make: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    interp = _OneNode(gm, garbage_collect_values=False)
    for inp in node.all_input_nodes:
        interp.env[inp] = _node_value(inp, gm, make)
    args, kwargs = interp.fetch_args_kwargs_from_env(node)
    if node.op == "output":
        return args, kwargs, args[0]
    result = interp.run_node(node)
    return ((), {}, result) if node.op == "get_attr" else (args, kwargs, result)


def _derive_one(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Record ``node``'s values computed from its inputs' metadata; False when it cannot run."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, kwargs, result = _run_one(gm, node, _fake)
    except Underivable:
        return False
    except Exception:  # noqa: BLE001 -- no fake implementation (e.g. data-dependent scales): run on zeros
        try:
            args, kwargs, result = _run_one(gm, node, _zeros)
        except Exception:  # noqa: BLE001 -- the op refuses to run now (e.g. an uncalibrated quantizer)
            return False
    record_node(node, gm, args, kwargs, result)
    return True


def derive_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """Re-derive ``nodes``' metadata (identity and values) from what their inputs record.

    Nodes run one by one in graph order on fake tensors of their inputs' recorded shapes (real zeros
    when an op has no fake implementation), in eval mode without grad, so the result equals a fresh
    add_common_metadata_analysis_pass. When a node's results change, its users are re-derived too.
    Software/hardware records stay. A node that cannot run (an input without values, an op that
    refuses, e.g. an uncalibrated static quantizer) keeps its identity only, without values, as a
    fresh pass could not record them either; the nodes left so are returned.
    """
    pending = set(nodes)
    missing: list[fx.Node] = []
    with evaluating(gm):
        for node in gm.graph.nodes:
            if node not in pending:
                continue
            old = get_meta(node) if has_meta(node) else None
            before = old.common.to_json()["results"] if old is not None else None
            init_node(node, gm)
            if old is not None:
                get_meta(node).software, get_meta(node).hardware = old.software, old.hardware
            if not _derive_one(gm, node):
                missing.append(node)
            if get_meta(node).common.to_json()["results"] != before:
                pending.update(node.users)
    return missing


def incomplete_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes whose values are missing (and the output node), for re-deriving after a state change."""
    return [n for n in gm.graph.nodes if n.op == "output" or not (has_meta(n) and get_meta(n).common.results)]
