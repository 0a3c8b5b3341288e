"""Raising fx to the fxforge IR: init_metadata_analysis_pass and add_common_metadata_analysis_pass."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.fx._pytree import tree_flatten_spec
from torch.fx.graph import _PyTreeCodeGen

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.ir import classify
from ...graph.metadata import CommonMeta, NodeMeta, ValueMeta, get_meta, has_meta, set_meta
from ..base import NoArgs, forge_pass


@forge_pass("analysis", NoArgs)
def init_metadata_analysis_pass(graph: ForgeGraph, args: NoArgs) -> tuple[ForgeGraph, dict[str, Any]]:
    """Give every node a fresh NodeMeta with its kind and canonical op (MASE's first raising pass)."""
    kinds: dict[str, int] = {}
    for node in graph.model.graph.nodes:
        kind, op = classify(node, graph.model)
        module_type = None
        if node.op == "call_module":
            cls = type(graph.model.get_submodule(str(node.target)))
            module_type = f"{cls.__module__}.{cls.__qualname__}"
        set_meta(node, NodeMeta(common=CommonMeta(kind=kind, op=op, module_type=module_type)))
        kinds[kind.value] = kinds.get(kind.value, 0) + 1
    return graph, {"nodes": sum(kinds.values()), "kinds": kinds}


@dataclass(frozen=True)
class CommonMetadataArgs:
    """dummy_in: inputs to propagate (a tensor, tuple of args, dict of kwargs); default: the
    graph's example inputs (HF models get them built from hf_input_names at capture)."""

    dummy_in: Any = None
    MASE_REFUSED: ClassVar[dict[str, str]] = {
        "add_value": "fxforge metadata records shapes, dtypes and precisions, never tensor values; drop the key"}


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


class _Recorder(fx.Interpreter):
    """Runs the graph once and writes what flows in and out of each node into its common metadata."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        meta = get_meta(n).common
        meta.args = {}
        if n.op not in ("placeholder", "get_attr", "output"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            for i, a in enumerate(args):
                if isinstance(a, list | tuple) and any(isinstance(x, torch.Tensor) for x in a):
                    for j, x in enumerate(a):
                        meta.args[f"data_in_{i}_{j}"] = ValueMeta.of(x)
                else:
                    meta.args[f"data_in_{i}"] = ValueMeta.of(a)
            for key, value in kwargs.items():
                meta.args[key] = ValueMeta.of(value)
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            for pname, param in module.named_parameters(recurse=False):
                meta.args[pname] = ValueMeta.of(param)
        if n.op == "output":
            values = result if isinstance(result, list | tuple) else (result,)
            meta.args = {f"data_in_{i}": ValueMeta.of(v) for i, v in enumerate(values)}
            meta.results = {}
        elif isinstance(result, list | tuple):
            meta.results = {f"data_out_{i}": ValueMeta.of(v) for i, v in enumerate(result)}
        else:
            meta.results = {"data_out_0": ValueMeta.of(result)}
        return result


@forge_pass("analysis", CommonMetadataArgs)
def add_common_metadata_analysis_pass(
    graph: ForgeGraph, args: CommonMetadataArgs
) -> tuple[ForgeGraph, dict[str, Any]]:
    """Propagate shapes, dtypes (complex included) and precisions by running the graph once.

    Runs torch.fx's Interpreter under no_grad in eval mode (dropout off, deterministic) and restores
    the graph's mode afterwards. Nodes without metadata get it initialised first.
    """
    example = graph.example_inputs if args.dummy_in is None else ExampleInputs.coerce(args.dummy_in)
    if example is None:
        raise ValueError("no inputs to propagate: pass {'dummy_in': ...} or capture with example_inputs")
    gm = graph.model
    if not all(has_meta(n) for n in gm.graph.nodes):
        init_metadata_analysis_pass(graph)
        graph.history.pop()  # the implicit init is part of this pass, not a separate step
    flat = flat_inputs(gm, example)
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            _Recorder(gm).run(*flat)
    finally:
        gm.train(was_training)
    complex_nodes = sum(
        1 for n in gm.graph.nodes
        if any(v.dtype and v.dtype.startswith("complex") for v in get_meta(n).common.results.values())
    )
    return graph, {"nodes": len(gm.graph.nodes), "complex_nodes": complex_nodes}
