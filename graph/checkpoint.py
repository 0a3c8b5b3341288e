"""Pickle-free checkpoints of a ForgeGraph: safetensors weights, JSON graph and metadata, SHA-256 manifest.

A checkpoint is a directory: ``graph.json`` (nodes, module tree, tensor roles, codegen specs, history;
versioned), ``metadata.json`` (node name → NodeMeta JSON), ``weights.safetensors`` (parameters, buffers
and constants, tied tensors once), ``example_inputs.safetensors`` and ``manifest.json`` (SHA-256 and
size of each file). Loading verifies the manifest first, resolves every call target, module class and
pytree type through the allowlist in :mod:`fxforge.graph.targets`, and returns nothing until the whole
graph is rebuilt. No pickle, no ``torch.load``, no ``exec``/``eval`` of checkpoint content.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from . import targets
from .checkpoint_values import IDENT, Env, decode_value, encode_value
from .inputs import ExampleInputs
from .metadata import SCHEMA_VERSION as METADATA_SCHEMA_VERSION
from .metadata import NodeMeta, get_meta, has_meta, set_meta
from .reference_outputs import outputs_of
from .targets import CheckpointError

if TYPE_CHECKING:
    from .forge_graph import ForgeGraph

__all__ = ["CHECKPOINT_SCHEMA_VERSION", "CheckpointError", "load_checkpoint", "reference_outputs", "save_checkpoint"]

FORMAT = "fxforge-checkpoint"
CHECKPOINT_SCHEMA_VERSION = 1
GRAPH, METADATA, WEIGHTS, INPUTS, MANIFEST = (
    "graph.json", "metadata.json", "weights.safetensors", "example_inputs.safetensors", "manifest.json")
OUTPUTS = "reference_outputs.safetensors"  # optional: graph/reference_outputs, checked by `fxforge verify`
_DATA_FILES = (GRAPH, METADATA, WEIGHTS, INPUTS, OUTPUTS)
_PART = re.compile(r"^[A-Za-z0-9_]+$")  # one component of a module/attribute path
_PLACEHOLDER = re.compile(r"^\*{0,2}[A-Za-z_][A-Za-z0-9_]*$")


def _check_path(path: str, where: str) -> list[str]:
    """The components of a dotted module/attribute path; each must be a plain name (no code, no dunders)."""
    parts = path.split(".")
    if not all(_PART.match(p) and not p.startswith("__") for p in parts):
        raise CheckpointError(f"{where}: bad module/attribute path {path!r}")
    return parts


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- saving ---------------------------------------------------------------------------------------------
def _collect_state(gm: fx.GraphModule) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Module tree (allowlisted classes + configs), tensor roles with aliases, and the tensors to store."""
    modules: list[dict[str, Any]] = []
    module_aliases: dict[str, str] = {}
    flags: dict[str, bool] = {}
    entries: list[dict[str, Any]] = []
    stored: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # id of a module or tensor → its first (canonical) path

    def record(name: str, t: torch.Tensor, kind: str, **extra: Any) -> None:
        _check_path(name, "tensor names")
        if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_meta:
            raise CheckpointError(f"tensor {name!r} ({type(t).__name__}, {t.layout}) cannot be stored: only "
                                  "dense tensors with real data are supported")
        entries.append({"name": name, "kind": kind, **extra})
        if id(t) in seen:
            entries[-1]["alias_of"] = seen[id(t)]
        else:
            seen[id(t)], stored[name] = name, t

    def visit(mod: nn.Module, path: str, owned: bool) -> None:
        seen[id(mod)] = path
        if path and not owned:  # modules inside a configured module are rebuilt by its from_config
            _check_path(path, "module tree")
            try:
                spec = targets.module_spec_for(mod)
            except CheckpointError as exc:
                raise CheckpointError(f"module {path!r}: {exc}") from None
            modules.append({"path": path, "class": spec.name,
                            "config": None if spec.to_config is None else spec.to_config(mod)})
            owned = not spec.container
        flags[path] = mod.training
        for name, p in mod._parameters.items():
            if p is not None:
                record(_join(path, name), p, "parameter", requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None:
                record(_join(path, name), b, "buffer", persistent=name not in mod._non_persistent_buffers_set)
        for name, c in vars(mod).items():
            if isinstance(c, torch.Tensor):
                record(_join(path, name), c, "constant")
        for name, child in mod._modules.items():
            if child is not None and id(child) in seen:
                module_aliases[_join(path, name)] = seen[id(child)]
            elif child is not None:
                visit(child, _join(path, name), owned)

    visit(gm, "", False)
    state = {"modules": modules, "module_aliases": module_aliases, "tensors": entries, "training": flags[""],
             "training_exceptions": {p: f for p, f in flags.items() if f != flags[""]}}
    return state, stored


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
    info, specs = codegen.pytree_info, {}
    for key in ("in_spec", "out_spec"):
        spec = getattr(info, key)
        try:
            specs[key] = None if spec is None else json.loads(pytree.treespec_dumps(spec))
        except Exception as exc:
            raise CheckpointError(f"cannot serialize the graph's {key} ({spec}): {exc}") from exc
        if specs[key] is not None:
            targets.check_treespec_json(specs[key])
    return {"kind": "pytree", "orig_args": list(info.orig_args), **specs}


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
            _check_path(str(target), where)
            if node.op == "call_module" or target not in tensor_names:
                gm.get_submodule(str(target))
    except (CheckpointError, AttributeError) as exc:
        raise CheckpointError(f"{where} ({node.op}): {exc}") from None
    if not IDENT.match(node.name) or not all(IDENT.match(k) for k in node.kwargs):
        raise CheckpointError(f"{where}: node names and keyword names must be identifiers")
    return {"name": node.name, "op": node.op, "target": target, "args": encode_value(list(node.args), where),
            "kwargs": {k: encode_value(v, where) for k, v in node.kwargs.items()}}


def _json_bytes(doc: Any, what: str) -> bytes:
    try:
        return json.dumps(doc, indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} is not JSON-serialisable: {exc}") from exc


def _write_dir(path: Path, files: dict[str, bytes]) -> None:
    """Write into a temporary sibling, then move it into place: never a half-written checkpoint."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory; choose another checkpoint path")
    stray = sorted(p.name for p in path.iterdir() if p.name not in (*_DATA_FILES, MANIFEST)) if path.is_dir() else []
    if stray:
        raise CheckpointError(f"{path}: holds files that are not part of an fxforge checkpoint ({stray[:3]}); "
                              "choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old = tmp.with_name(tmp.name + ".old")
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if path.is_dir():
            path.rename(old)
        tmp.rename(path)
    except BaseException:
        if old.is_dir() and not path.exists():
            old.rename(path)  # put the previous checkpoint back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(mg: ForgeGraph, path: str | Path) -> Path:
    """Write ``mg`` as a pickle-free checkpoint directory at ``path`` (dots allowed); returns the path.

    Fails, writing nothing, with CheckpointError when the graph uses a target, module class or value
    that the allowlist in :mod:`fxforge.graph.targets` cannot name.
    """
    path, gm = Path(path), mg.model
    state, tensors = _collect_state(gm)
    nodes = [_node_json(n, gm, {e["name"] for e in state["tensors"]}) for n in gm.graph.nodes]
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
        "class_name": class_name if IDENT.match(class_name) else "GraphModule", **state,
        "codegen": _codegen_json(gm.graph), "nodes": nodes, "example_inputs": inputs_doc,
        "history": [r.to_json() for r in mg.history], "capture_notes": list(mg.capture_notes),
    }
    metadata_doc = {"schema_version": METADATA_SCHEMA_VERSION,
                    "nodes": {n.name: get_meta(n).to_json() for n in gm.graph.nodes if has_meta(n)}}
    files[GRAPH] = _json_bytes(graph_doc, "graph")
    files[METADATA] = _json_bytes(metadata_doc, "node metadata")
    files[WEIGHTS] = _safetensors_bytes(tensors, WEIGHTS)
    files[MANIFEST] = _json_bytes({"format": FORMAT, "schema_version": CHECKPOINT_SCHEMA_VERSION, "files": {
        k: {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)} for k, v in files.items()}}, "manifest")
    _write_dir(path, files)
    return path


# -- loading --------------------------------------------------------------------------------------------
def _read_verified(root: Path) -> dict[str, bytes]:
    """Every file the manifest lists, read once and checked (size, SHA-256) before anything is parsed."""
    mpath = root / MANIFEST
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: missing; {root} is not a complete fxforge checkpoint")
    try:
        manifest = json.loads(mpath.read_bytes())
        files, version = manifest["files"], manifest["schema_version"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or type(version) is not int:
            raise ValueError("not an fxforge manifest")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{mpath}: unreadable or corrupt manifest ({exc})") from None
    if version > CHECKPOINT_SCHEMA_VERSION:
        raise CheckpointError(f"{mpath}: schema version {version} is newer than this fxforge reads "
                              f"({CHECKPOINT_SCHEMA_VERSION}); upgrade fxforge")
    missing = [f for f in (GRAPH, METADATA, WEIGHTS) if f not in files]
    if missing or set(files) - set(_DATA_FILES):
        raise CheckpointError(f"{mpath}: must list {GRAPH}, {METADATA}, {WEIGHTS} (optionally {INPUTS}, "
                              f"{OUTPUTS}), lists {sorted(files)}")
    payloads: dict[str, bytes] = {}
    for name, info in files.items():
        if not (root / name).is_file():
            raise CheckpointError(f"{root / name}: missing (listed in {MANIFEST})")
        data = (root / name).read_bytes()
        if not isinstance(info, dict) or len(data) != info.get("size") \
                or hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise CheckpointError(f"{root / name}: size/SHA-256 does not match {MANIFEST}; the file is corrupt "
                                  "or was modified after export")
        payloads[name] = data
    return payloads


def _parse(root: Path, name: str, payloads: dict[str, bytes]) -> Any:
    """A verified file parsed as JSON or safetensors (never pickle); errors name the file."""
    try:
        if name.endswith(".json"):
            return json.loads(payloads[name])
        return safetensors.torch.load(payloads[name]) if name in payloads else {}
    except Exception as exc:
        raise CheckpointError(f"{root / name}: unreadable file ({type(exc).__name__}: {exc})") from None


def _build_modules(gm: fx.GraphModule, doc: dict[str, Any]) -> None:
    """Rebuild the module tree on ``gm`` from allowlisted classes; configured modules on the meta device."""
    for entry in doc["modules"]:
        path = entry["path"]
        *parents, leaf = _check_path(path, "module tree")
        parent = gm.get_submodule(".".join(parents))
        if parent is not gm and not targets.module_spec_for(parent).container:
            raise CheckpointError(f"module {path!r}: its parent is not a container")
        spec = targets.resolve_module(entry["class"])
        if spec.from_config is None:
            module = spec.cls()
        elif isinstance(entry.get("config"), dict):
            with torch.device("meta"):
                module = spec.from_config(dict(entry["config"]))
        else:
            raise CheckpointError(f"module {path!r}: config must be a JSON object")
        if type(module) is not spec.cls:
            raise CheckpointError(f"module {path!r}: {spec.name} built a {type(module).__name__}")
        parent.add_module(leaf, module)
    for alias, target in doc["module_aliases"].items():
        *parents, leaf = _check_path(alias, "module aliases")
        gm.get_submodule(".".join(parents)).add_module(leaf, gm.get_submodule(".".join(_check_path(target, alias))))


def _attach_tensors(gm: fx.GraphModule, doc: dict[str, Any], weights: dict[str, torch.Tensor], wpath: Path) -> None:
    """Attach parameters, buffers and constants, re-tying aliases; every stored tensor must be used."""
    made: dict[str, torch.Tensor] = {}
    for e in doc["tensors"]:
        name, kind, alias = e["name"], e["kind"], e.get("alias_of")
        *parents, attr = _check_path(name, "tensors")
        owner = gm.get_submodule(".".join(parents))
        if alias is not None and alias not in made:
            raise CheckpointError(f"tensor {name!r} is an alias of unknown tensor {alias!r}")
        if alias is None and name not in weights:
            raise CheckpointError(f"{wpath}: tensor {name!r} is missing")
        value = made[alias] if alias is not None else weights[name]
        if kind == "parameter":
            if not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=bool(e.get("requires_grad", True)))
            owner.register_parameter(attr, value)
        elif kind == "buffer":
            owner.register_buffer(attr, value, persistent=bool(e.get("persistent", True)))
        elif kind == "constant" and not any(attr in d for d in (owner._parameters, owner._buffers, owner._modules)) \
                and isinstance(getattr(owner, attr, value), torch.Tensor):
            setattr(owner, attr, value)
        else:
            raise CheckpointError(f"tensor {name!r}: bad kind {kind!r} or it clashes with an attribute")
        made[name] = value
    unused = sorted(set(weights) - set(made))
    if unused:
        raise CheckpointError(f"{wpath}: holds tensors graph.json does not mention: {unused[:5]}")
    for mname, mod in gm.named_modules(remove_duplicate=False):
        for tname, t in (*mod._parameters.items(), *mod._buffers.items(), *vars(mod).items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise CheckpointError(f"{wpath}: no value for {_join(mname, tname)!r} (module built without it)")


def _target(gm: fx.GraphModule, op: str, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The object a node calls or names, through the allowlist only (strings for non-call ops)."""
    if op == "call_function":
        targets.check_call(target, args, kwargs)
        return targets.resolve_function(target)
    if op == "call_method":
        return targets.check_method(target)
    if op in ("call_module", "get_attr"):
        *parents, attr = _check_path(target, "target")
        owner = gm.get_submodule(".".join(parents))
        tensors = (owner._parameters, owner._buffers) if op == "get_attr" else ()
        if attr in owner._modules or any(attr in d for d in tensors) or \
                (op == "get_attr" and isinstance(vars(owner).get(attr), torch.Tensor)):
            return target
        raise CheckpointError(f"{target!r} is not a stored {'tensor or ' if op == 'get_attr' else ''}module")
    if (op == "placeholder" and _PLACEHOLDER.match(target)) or (op == "output" and target == "output"):
        return target
    raise CheckpointError(f"bad {op} target {target!r}")


def _build_graph(gm: fx.GraphModule, doc: dict[str, Any]) -> fx.Graph:
    """Recreate every node with ``graph.create_node`` and restore the pytree calling convention."""
    graph, env = fx.Graph(), Env()
    for entry in doc["nodes"]:
        name, op, target = entry.get("name"), entry.get("op"), entry.get("target")
        where, kwargs = f"node {name!r}", entry.get("kwargs", {})
        if not isinstance(name, str) or not IDENT.match(name) or not isinstance(target, str) \
                or not isinstance(kwargs, dict) or not all(IDENT.match(k) for k in kwargs):
            raise CheckpointError(f"{where}: malformed node (names and keywords must be identifiers)")
        args = tuple(decode_value(entry.get("args", []), where, env))
        kwargs = {k: decode_value(v, where, env) for k, v in kwargs.items()}
        try:
            fn = _target(gm, op, target, args, kwargs)
        except (CheckpointError, AttributeError) as exc:
            raise CheckpointError(f"{where} ({op} {target!r}): {exc}") from None
        node = graph.create_node(op, fn, args, kwargs, name=name)
        if node.name != name:
            raise CheckpointError(f"{where}: name is taken or reserved (became {node.name!r})")
        env[("node", name)] = node
    codegen = doc["codegen"]
    if codegen["kind"] == "pytree":
        specs = {}
        for key in ("in_spec", "out_spec"):
            if codegen[key] is not None:
                targets.check_treespec_json(codegen[key])
            specs[key] = None if codegen[key] is None else pytree.treespec_loads(json.dumps(codegen[key]))
        orig_args = codegen["orig_args"]
        if not all(isinstance(a, str) and IDENT.match(a) for a in orig_args):
            raise CheckpointError("codegen orig_args must be identifiers")
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(orig_args), specs["in_spec"], specs["out_spec"]))
    elif codegen["kind"] != "default":
        raise CheckpointError(f"unknown codegen kind {codegen['kind']!r}")
    return graph


def _restore_metadata(graph: fx.Graph, doc: Any, mpath: Path) -> None:
    """Attach NodeMeta from metadata.json; fxforge's own pass records are registered on demand."""
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if version != METADATA_SCHEMA_VERSION or not isinstance(doc.get("nodes"), dict):
        raise CheckpointError(f"{mpath}: metadata schema version {version!r} is not {METADATA_SCHEMA_VERSION}")
    nodes = {n.name: n for n in graph.nodes}
    for name, data in doc["nodes"].items():
        if name not in nodes:
            raise CheckpointError(f"{mpath}: metadata for unknown node {name!r}")
        try:
            try:
                meta = NodeMeta.from_json(data)
            except ValueError:  # perhaps a record whose pass module is not imported yet
                from .. import passes  # noqa: F401

                meta = NodeMeta.from_json(data)
        except Exception as exc:
            raise CheckpointError(f"{mpath}: node {name!r}: bad metadata ({exc}); import the module that "
                                  "registers its records") from None
        set_meta(nodes[name], meta)


def reference_outputs(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The outputs recorded at export (manifest-verified), or None when the checkpoint recorded none."""
    root = Path(path)
    payloads = _read_verified(root)
    return _parse(root, OUTPUTS, payloads) if OUTPUTS in payloads else None


def load_checkpoint(path: str | Path) -> ForgeGraph:
    """Load a checkpoint written by :func:`save_checkpoint`; CheckpointError names the failing file.

    The manifest is verified first and every target is resolved through the allowlist, so loading
    never runs code the checkpoint chose. Nothing is returned unless every step succeeded.
    """
    from .forge_graph import ForgeGraph, PassRecord

    root = Path(path)
    payloads = _read_verified(root)
    gpath = root / GRAPH
    doc = _parse(root, GRAPH, payloads)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or type(doc.get("schema_version")) is not int:
        raise CheckpointError(f"{gpath}: not an fxforge graph")
    if doc["schema_version"] > CHECKPOINT_SCHEMA_VERSION:
        raise CheckpointError(f"{gpath}: schema version {doc['schema_version']} is newer than this fxforge reads "
                              f"({CHECKPOINT_SCHEMA_VERSION}); upgrade fxforge")
    weights, input_tensors = _parse(root, WEIGHTS, payloads), _parse(root, INPUTS, payloads)
    try:
        class_name, frontend = doc["class_name"], doc["frontend"]
        if not IDENT.match(str(class_name)) or frontend not in ("fx", "export"):
            raise CheckpointError(f"bad class name {class_name!r} or frontend {frontend!r}")
        gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
        _build_modules(gm, doc)
        _attach_tensors(gm, doc, weights, root / WEIGHTS)
        graph = _build_graph(gm, doc)
        gm.graph = graph  # recompiles: the code is generated from allowlisted nodes only
        graph.lint()
        gm.train(bool(doc["training"]))
        for module_path, flag in doc["training_exceptions"].items():
            gm.get_submodule(".".join(_check_path(module_path, "training flags"))).training = bool(flag)
        example_inputs, ex = None, doc["example_inputs"]
        if ex is not None:
            env = {("tensor", k): v for k, v in input_tensors.items()}
            example_inputs = ExampleInputs(tuple(decode_value(ex["args"], "example_inputs", env)),
                                           decode_value(ex["kwargs"], "example_inputs", env))
        history = [PassRecord.from_json(h) for h in doc["history"]]
        notes = [str(n) for n in doc["capture_notes"]]
    except CheckpointError as exc:
        raise CheckpointError(str(exc) if str(root) in str(exc) else f"{gpath}: {exc}") from None
    except Exception as exc:
        raise CheckpointError(f"{gpath}: malformed checkpoint graph ({type(exc).__name__}: {exc})") from exc
    _restore_metadata(graph, _parse(root, METADATA, payloads), root / METADATA)
    return ForgeGraph.from_parts(gm, frontend, example_inputs, history, notes)
