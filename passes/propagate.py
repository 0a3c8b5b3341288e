"""Metadata propagation, one implementation for the metadata passes and the rewrite engine.

``fresh_common`` says what a node is (kind, canonical op, module type); ``record_node`` writes what
flows in and out of it; :func:`propagate_graph` runs the whole graph once (torch.fx Interpreter) and
:func:`derive_nodes` re-derives only some nodes from the metadata recorded on their inputs (fake
tensors of the recorded shapes, real zeros when an op cannot run on fake tensors), so a rewrite's new
nodes get exactly what a fresh metadata pass would record without running the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._pytree import tree_flatten_spec
from torch.fx.graph import _PyTreeCodeGen

from ..graph.inputs import ExampleInputs
from ..graph.ir import classify, module_type_name
from ..graph.metadata import CommonMeta, NodeMeta, ValueMeta, dtype_from_name, get_meta, has_meta, set_meta

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

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n) if n.op not in ("placeholder", "get_attr") else ((), {})
        record_node(n, self.module, args, kwargs, result)
        return result


def flat_inputs(gm: fx.GraphModule, example: ExampleInputs) -> list[Any]:
    """The placeholder values for calling ``gm(*args, **kwargs)``, in placeholder order."""
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info.in_spec is not None:
        info = codegen.pytree_info
        sig = inspect.Signature([
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in info.orig_args
        ])
        bound = sig.bind(*example.args, **example.kwargs)
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
    bound = inspect.Signature(params).bind(*example.args, **example.kwargs)
    bound.apply_defaults()
    return list(bound.arguments.values())


def propagate_graph(gm: fx.GraphModule, example: ExampleInputs) -> None:
    """Initialise missing metadata, then run the graph once (eval, no_grad) recording every node's values."""
    for node in gm.graph.nodes:
        if not has_meta(node):
            init_node(node, gm)
    flat = flat_inputs(gm, example)
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat)
    finally:
        gm.train(was_training)


# -- local derivation -------------------------------------------------------------------------------
def _value(meta: ValueMeta, make: Any) -> Any:
    if meta.type == "tensor":
        assert meta.shape is not None and meta.dtype is not None
        return make(meta.shape, dtype_from_name(meta.dtype))
    if meta.type == "none":
        return None
    if meta.type == "scalar" and not isinstance(meta.value, str):
        return meta.value
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


def _derive_one(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], make: Any) -> None:
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    for inp in node.all_input_nodes:
        interp.env[inp] = env[inp] if inp in env else _node_value(inp, gm, make)
    args, kwargs = interp.fetch_args_kwargs_from_env(node)
    result = interp.run_node(node) if node.op != "output" else args[0]
    env[node] = result
    if node.op == "get_attr":
        args, kwargs = (), {}
    record_node(node, gm, args, kwargs, result)


def derive_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> None:
    """Re-derive ``nodes``' metadata (identity and values) from what their inputs record.

    Nodes run in graph order on fake tensors of their inputs' recorded shapes (real zeros when an op
    cannot run on fake tensors, e.g. data-dependent quantizer scales), in eval mode without grad, so
    the result equals a fresh add_common_metadata_analysis_pass. When a node's results change, its
    users are re-derived too. Raises :class:`Underivable` when an input records no value.
    """
    was_training = gm.training
    gm.eval()
    wanted = list(nodes)
    try:
        with torch.no_grad():
            try:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    _derive(gm, wanted, lambda s, d: torch.empty(s, dtype=d))
            except Underivable:
                raise
            except Exception:  # noqa: BLE001 -- an op without a fake implementation: run it for real
                _derive(gm, wanted, lambda s, d: torch.zeros(s, dtype=d))
    finally:
        gm.train(was_training)


def _derive(gm: fx.GraphModule, nodes: list[fx.Node], make: Any) -> None:
    pending = set(nodes)
    env: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node not in pending:
            continue
        old = get_meta(node) if has_meta(node) else None
        before = old.common.to_json() if old is not None else None
        init_node(node, gm)
        if old is not None:
            get_meta(node).software, get_meta(node).hardware = old.software, old.hardware
        _derive_one(gm, node, env, make)
        if get_meta(node).common.to_json()["results"] != (before or {}).get("results"):
            pending.update(node.users)
