"""Pickle-free checkpoints of a ForgeGraph: safetensors weights, JSON graph and metadata, SHA-256 manifest.

A checkpoint is a directory: ``graph.json`` (nodes, module tree, tensor roles, codegen specs, history;
versioned), ``metadata.json`` (node name → NodeMeta JSON), ``weights.safetensors`` (parameters, buffers
and constants, tied tensors once), ``example_inputs.safetensors`` and ``manifest.json`` (SHA-256 and
size of each file). Loading verifies the manifest first, resolves every call target, module class and
pytree type through the allowlist in :mod:`fxforge.graph.targets`, and returns nothing until the whole
graph is rebuilt. No pickle, no ``torch.load``, no ``exec``/``eval`` of checkpoint content.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import _PyTreeCodeGen

from . import targets
from .atomic import dumps_json, write_checkpoint_dir
from .checkpoint_load import (
    CHECKPOINT_SCHEMA_VERSION,
    DATA_FILES,
    FORMAT,
    GRAPH,
    INPUTS,
    METADATA,
    OUTPUTS,
    WEIGHTS,
    load_checkpoint,
    reference_outputs,
)
from .checkpoint_packed import PackPlan, packed_json, plan_packing
from .checkpoint_values import IDENT, check_module_stack, check_node_name, check_path, encode_value, join
from .known_ops import op_schema
from .limits import MAX_CLASS_NAME_CHARS
from .metadata import SCHEMA_VERSION as METADATA_SCHEMA_VERSION
from .metadata import dtype_name, get_meta, has_meta
from .packed import packers
from .reference_outputs import outputs_of
from .stored_writes import StoredReach
from .targets import CheckpointError, is_identifier
from .tensor_layout import dim_order, to_stored
from .treespec import encode_spec

if TYPE_CHECKING:
    from .forge_graph import ForgeGraph

__all__ = ["CHECKPOINT_SCHEMA_VERSION", "CheckpointError", "load_checkpoint", "reference_outputs", "save_checkpoint"]

# -- saving ---------------------------------------------------------------------------------------------
def _collect_state(gm: fx.GraphModule, pack: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Module tree (allowlisted classes + configs), tensor roles with aliases, and the tensors to store;
    with ``pack``, quantized layers' tensors as their packed parts (graph/checkpoint_packed)."""
    modules: list[dict[str, Any]] = []
    module_aliases: dict[str, str] = {}
    flags: dict[str, bool] = {}
    pending: list[tuple[str, torch.Tensor, str, dict[str, Any], nn.Module, str]] = []
    recorded: dict[int, tuple[nn.Module, dict[str, Any]]] = {}  # id(module) -> module, its modules[] entry
    seen_modules: dict[int, str] = {}

    def visit(mod: nn.Module, path: str, owned: bool) -> None:
        seen_modules[id(mod)] = path
        if path and not owned:  # modules inside a configured module are rebuilt by its from_config
            check_path(path, "module tree")
            try:
                spec = targets.module_spec_for(mod)
            except CheckpointError as exc:
                raise CheckpointError(f"module {path!r}: {exc}") from None
            modules.append({"path": path, "class": spec.name,
                            "config": None if spec.to_config is None else spec.to_config(mod)})
            recorded[id(mod)] = (mod, modules[-1])
            owned = not spec.container
        flags[path] = mod.training
        for name, p in mod._parameters.items():
            if p is not None:
                pending.append((join(path, name), p, "parameter", {"requires_grad": p.requires_grad}, mod, name))
        for name, b in mod._buffers.items():
            if b is not None:
                pending.append((join(path, name), b, "buffer",
                                {"persistent": name not in mod._non_persistent_buffers_set}, mod, name))
        for name, c in vars(mod).items():
            if isinstance(c, torch.Tensor):
                pending.append((join(path, name), c, "constant", {}, mod, name))
        for name, child in mod._modules.items():
            if child is not None and id(child) in seen_modules:
                module_aliases[join(path, name)] = seen_modules[id(child)]
            elif child is not None:
                visit(child, join(path, name), owned)

    visit(gm, "", False)
    plan = PackPlan()
    if pack:
        direct = {id(t) for n in gm.graph.nodes if n.op == "get_attr"
                  for t in [_attr_tensor(gm, str(n.target))] if t is not None}
        uses = [(name.rpartition(".")[0], mod, attr, t) for name, t, _, _, mod, attr in pending]
        plan = plan_packing(uses, direct, {i for i in recorded if i != id(gm)})
    for mid, (mod, entry) in recorded.items():  # every packer marks every config: packed attrs, or none
        marked = plan.marks.get(mid)
        for packer in packers():
            if isinstance(entry["config"], dict):
                attrs = marked[1] if marked is not None and marked[0] is packer else set()
                entry["config"] = packer.mark(mod, entry["config"], frozenset(attrs))
    entries, stored = _record_tensors(pending, plan)
    state = {"modules": modules, "module_aliases": module_aliases, "tensors": entries, "training": flags[""],
             "training_exceptions": {p: f for p, f in flags.items() if f != flags[""]}}
    return state, stored


def _attr_tensor(gm: fx.GraphModule, target: str) -> torch.Tensor | None:
    """The tensor a get_attr node reads (None for anything else)."""
    owner, _, attr = target.rpartition(".")
    try:
        value = getattr(gm.get_submodule(owner), attr, None)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


def _record_tensors(pending: list[tuple[str, torch.Tensor, str, dict[str, Any], nn.Module, str]],
                    plan: PackPlan) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """graph.json's tensor entries (aliases of a tensor seen earlier by name) and the tensors to store."""
    entries: list[dict[str, Any]] = []
    stored: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # id of a tensor -> its first (canonical) path
    for name, t, kind, extra, _, _ in pending:
        check_path(name, "tensor names")
        if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_meta:
            raise CheckpointError(f"tensor {name!r} ({type(t).__name__}, {t.layout}) cannot be stored: only "
                                  "dense tensors with real data are supported")
        entries.append({"name": name, "kind": kind, **extra, "shape": list(t.shape), "dtype": dtype_name(t.dtype)})
        if id(t) in seen:
            entries[-1]["alias_of"] = seen[id(t)]
            continue
        seen[id(t)] = name
        record = plan.records.get(id(t))
        if record is not None:
            entries[-1]["packed"], parts = packed_json(name, record)
            stored.update(parts)
            continue
        if id(t) in plan.reasons:
            entries[-1]["unpacked"] = plan.reasons[id(t)]
        order = dim_order(t)  # a permuted view is stored in memory order and loaded as the same view
        if order is not None:
            entries[-1]["dim_order"] = order
        stored[name] = to_stored(t, order)
    return entries, stored


def _safetensors_bytes(tensors: dict[str, torch.Tensor], what: str) -> bytes:
    """safetensors bytes of detached, contiguous CPU copies that share no storage (safetensors' rule)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.contiguous().clone() if ptr in storages or not t.is_contiguous() else t
        storages.add(ptr or -1)
    try:
        return safetensors.torch.save(out, metadata={"format": "pt"})
    except Exception as exc:
        raise CheckpointError(f"cannot write {what}: {exc}") from exc


def _codegen_json(graph: fx.Graph) -> dict[str, Any]:
    """The graph's calling convention: default, or pytree in/out specs (e.g. HF ModelOutput types)."""
    codegen = graph._codegen
    if type(codegen) is fx.graph.CodeGen:
        return {"kind": "default"}
    if type(codegen) is not _PyTreeCodeGen:
        raise CheckpointError(f"graph codegen {type(codegen).__name__} is not supported by checkpoints")
    info = codegen.pytree_info
    if not all(is_identifier(a) for a in info.orig_args):
        raise CheckpointError(f"graph argument names {list(info.orig_args)} must be identifiers")
    specs = {k: None if getattr(info, k) is None else encode_spec(getattr(info, k), f"graph {k}")
             for k in ("in_spec", "out_spec")}
    return {"kind": "pytree", "orig_args": list(info.orig_args), **specs}


def _module_stack_json(node: fx.Node) -> list[list[str]] | None:
    """The capture's module stack of ``node`` as [path, class name] pairs, outermost first (the report groups
    nodes by it); None without one, or when a path is one a checkpoint cannot name (torch's
    ``layers.slice(None, 2, None).0`` of a sliced ModuleList): the loaded node's module is then inferred."""
    stack = node.meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return None
    out = []
    for value in stack.values():
        if not isinstance(value, tuple | list) or len(value) != 2:
            return None
        path, cls = value
        name = (cls if isinstance(cls, str) else getattr(cls, "__qualname__", "")).rpartition(".")[2]
        out.append([path, name if IDENT.match(name) and len(name) <= MAX_CLASS_NAME_CHARS else ""])
    try:
        check_module_stack(out, "")
    except CheckpointError:
        return None
    return out


def _node_json(node: fx.Node, gm: fx.GraphModule, tensor_names: set[str]) -> dict[str, Any]:
    """One node as JSON; refuses targets the loader could not resolve."""
    where, target = f"node {node.name!r}", node.target
    try:
        if node.op == "call_function":
            target = targets.function_name(node.target)
            targets.check_call(target, node.args, dict(node.kwargs))
        elif node.op == "call_method":
            targets.check_method(node.target)
        elif node.op in ("call_module", "get_attr"):
            check_path(str(target), where)
            if node.op == "call_module" or target not in tensor_names:
                gm.get_submodule(str(target))
    except (CheckpointError, AttributeError) as exc:
        raise CheckpointError(f"{where} ({node.op}): {exc}") from None
    check_node_name(node.name, where)
    if not all(is_identifier(k) for k in node.kwargs):
        raise CheckpointError(f"{where}: keyword names must be identifiers")
    schema = op_schema(node.target) if node.op == "call_function" else None
    stack = _module_stack_json(node)
    return {"name": node.name, "op": node.op, "target": target, "args": encode_value(list(node.args), where),
            "kwargs": {k: encode_value(v, where) for k, v in node.kwargs.items()},
            **({"schema": schema} if schema else {}),  # ops outside aten/prims: checked against the live op
            **({"module_stack": stack} if stack else {})}


def save_checkpoint(mg: ForgeGraph, path: str | Path, pack: bool = True) -> Path:
    """Write ``mg`` as a pickle-free checkpoint directory at ``path`` (dots allowed); returns the path.

    With ``pack`` (default) every quantized layer's weight a codec reproduces exactly is stored at its format's
    width and reloads as those quantized values, passed through by its quantizer (for inference, or
    fine-tuning from the quantized values); ``pack=False`` keeps the float weights (QAT from them).

    Fails, writing nothing, with CheckpointError when the graph uses a target, module class or value
    that the allowlist in :mod:`fxforge.graph.targets` cannot name.
    """
    path, gm = Path(path), mg.model
    state, tensors = _collect_state(gm, pack)
    nodes = [_node_json(n, gm, {e["name"] for e in state["tensors"]}) for n in gm.graph.nodes]
    reach = StoredReach(gm)  # the loader's rule, checked before anything is written
    for n in gm.graph.nodes:
        try:
            reach.add(n)
        except CheckpointError as exc:
            raise CheckpointError(f"node {n.name!r} ({n.op} {n.target}): {exc}") from None
    files: dict[str, bytes] = {}
    inputs_doc = None
    if mg.example_inputs is not None:
        inputs: dict[str, torch.Tensor] = {}

        def sink(t: torch.Tensor) -> str:
            inputs[f"t{len(inputs)}"] = t
            return f"t{len(inputs) - 1}"

        ex = mg.example_inputs
        inputs_doc = {"args": encode_value(list(ex.args), "example_inputs", sink),
                      "kwargs": encode_value(dict(ex.kwargs), "example_inputs", sink)}
        files[INPUTS] = _safetensors_bytes(inputs, INPUTS)
        recorded = outputs_of(mg)
        if recorded is not None:
            files[OUTPUTS] = _safetensors_bytes(recorded, OUTPUTS)
    class_name = type(gm).__name__
    graph_doc = {
        "format": FORMAT, "schema_version": CHECKPOINT_SCHEMA_VERSION, "frontend": mg.frontend,
        "class_name": class_name if is_identifier(class_name) else "GraphModule", **state,
        "codegen": _codegen_json(gm.graph), "nodes": nodes, "example_inputs": inputs_doc,
        "history": [r.to_json() for r in mg.history], "capture_notes": list(mg.capture_notes),
    }
    metadata_doc = {"schema_version": METADATA_SCHEMA_VERSION,
                    "nodes": {n.name: get_meta(n).to_json() for n in gm.graph.nodes if has_meta(n)}}
    files[GRAPH] = dumps_json(graph_doc, "graph")
    files[METADATA] = dumps_json(metadata_doc, "node metadata")
    files[WEIGHTS] = _safetensors_bytes(tensors, WEIGHTS)
    return write_checkpoint_dir(path, files, FORMAT, CHECKPOINT_SCHEMA_VERSION, allowed=DATA_FILES)


