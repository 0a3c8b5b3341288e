"""Loading a checkpoint directory written by :func:`fxforge.graph.checkpoint.save_checkpoint`.

Every string in it is hostile: files are read through :mod:`.atomic` (manifest first, no symlinks,
sizes before bytes, bounded JSON), names are strict identifiers, call targets, module classes and
output classes resolve only through the allowlist in :mod:`.targets` (nothing is imported), configured
modules are built on the meta device from allowlisted constructor keys, and every weight must have the
shape and dtype its module declares. The generated ``forward`` only ever sees checked identifiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils._pytree import TreeSpec

from . import targets
from .atomic import loads_json, read_verified
from .checkpoint_packed import decode_packed
from .checkpoint_values import Env, check_module_stack, check_node_name, check_path, decode_value, join
from .inputs import ExampleInputs
from .limits import check_graph_size
from .metadata import SCHEMA_VERSION as METADATA_SCHEMA_VERSION
from .metadata import NodeMeta, set_meta
from .packed import PackedTensor, packers
from .stored_writes import StoredReach
from .targets import CheckpointError, is_identifier
from .tensor_layout import from_stored
from .treespec import decode_spec, translate_v1_spec

if TYPE_CHECKING:
    from .forge_graph import ForgeGraph

FORMAT = "fxforge-checkpoint"
CHECKPOINT_SCHEMA_VERSION = 4  # 4: quantized layers' tensors packed (graph/checkpoint_packed); 3: every tensor's
READABLE_VERSIONS = (1, 2, 3, 4)  # shape and dtype recorded; 2: pytree structure in fxforge's schema; 1: torch
#                                   treespec JSON (translated). A node's optional "module_stack" (added within 4)
#                                   changes no node's meaning, older readers skip it, a node without one loads as
#                                   before: no new version.
GRAPH, METADATA, WEIGHTS, INPUTS = "graph.json", "metadata.json", "weights.safetensors", "example_inputs.safetensors"
OUTPUTS = "reference_outputs.safetensors"  # optional: graph/reference_outputs, checked by `fxforge verify`
DATA_FILES = (GRAPH, METADATA, WEIGHTS, INPUTS, OUTPUTS)
_CONFIG_SCALARS = (bool, int, float, str, type(None))


def _parse(root: Path, name: str, payloads: dict[str, bytes]) -> Any:
    """A verified file parsed as JSON or safetensors (never pickle); errors name the file."""
    try:
        if name.endswith(".json"):
            return loads_json(payloads[name], str(root / name))
        return safetensors.torch.load(payloads[name]) if name in payloads else {}
    except Exception as exc:
        raise CheckpointError(f"{root / name}: unreadable file ({type(exc).__name__}: {exc})") from None


def _check_config(path: str, spec: targets.ModuleSpec, config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise CheckpointError(f"module {path!r}: config must be a JSON object")
    if spec.keys is not None and not set(config) <= spec.keys:
        raise CheckpointError(f"module {path!r}: config keys {sorted(set(config) - spec.keys)} are not "
                              f"constructor keys of {spec.name}; allowed: {sorted(spec.keys)}")
    if spec.keys is None:  # the class's own from_config validates its (nested JSON) config
        return dict(config)
    for key, value in config.items():  # constructor keyword arguments: scalars or lists of scalars only
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, _CONFIG_SCALARS) for v in items):
            raise CheckpointError(f"module {path!r}: config[{key!r}] must be a scalar or a list of scalars")
    return dict(config)


def _build_modules(gm: fx.GraphModule, doc: dict[str, Any]) -> set[int]:
    """Rebuild the module tree from allowlisted classes; configured modules on the meta device.

    Returns the ids of every module built from a config (their tensors are declared by the config).
    """
    configured: set[int] = set()
    for entry in doc["modules"]:
        path = entry["path"]
        *parents, leaf = check_path(path, "module tree")
        parent = gm.get_submodule(".".join(parents))
        if parent is not gm and not targets.module_spec_for(parent).container:
            raise CheckpointError(f"module {path!r}: its parent is not a container")
        if hasattr(parent, leaf) and leaf not in parent._modules:
            raise CheckpointError(f"module {path!r}: clashes with an attribute of its parent")
        spec = targets.resolve_module(entry["class"])
        if spec.from_config is None:
            module = spec.cls()
        else:
            config = _check_config(path, spec, entry.get("config"))
            with torch.device("meta"):
                module = spec.from_config(config)
            configured.update(id(m) for m in module.modules())
        if type(module) is not spec.cls:
            raise CheckpointError(f"module {path!r}: {spec.name} built a {type(module).__name__}")
        parent.add_module(leaf, module)
    for alias, target in doc["module_aliases"].items():
        *parents, leaf = check_path(alias, "module aliases")
        gm.get_submodule(".".join(parents)).add_module(leaf, gm.get_submodule(".".join(check_path(target, alias))))
    return configured


def _check_record(i: int, e: dict[str, Any], value: torch.Tensor, wpath: Path, version: int) -> None:
    """A tensor must have the shape and dtype graph.json records for it (required from schema 3 on)."""
    if version < 3 and "shape" not in e and "dtype" not in e:
        return
    shape, dtype = e.get("shape"), e.get("dtype")
    if not isinstance(shape, list) or len(shape) > 64 or not all(type(s) is int and s >= 0 for s in shape) \
            or not isinstance(dtype, str) or not is_identifier(dtype) or dtype.startswith("_") \
            or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise CheckpointError(f"{wpath.with_name(GRAPH)}: tensors[{i}] ({e['name']!r}): shape must be a list of at "
                              "most 64 non-negative integers and dtype a torch dtype name")
    if (tuple(value.shape), value.dtype) != (tuple(shape), getattr(torch, dtype)):
        raise CheckpointError(f"{wpath}: tensor {e['name']!r} is {tuple(value.shape)} {value.dtype}; {GRAPH} records "
                              f"{tuple(shape)} {getattr(torch, dtype)}")


def _check_packed_uses(gm: fx.GraphModule, records: dict[str, PackedTensor], wpath: Path) -> None:
    """Every packed tensor (aliases included) must be one a packer stores packed for its module, with the
    record its config would write, and no module may pass values through that were not stored packed."""
    claimed: set[str] = set()
    for p in packers():
        try:
            claimed |= p.check(gm, records)
        except ValueError as exc:
            raise CheckpointError(f"{wpath}: {exc}"[:800]) from None
    for name in sorted(set(records) - claimed):
        path, _, attr = name.rpartition(".")
        module = gm.get_submodule(path)
        raise CheckpointError(f"{wpath}: tensor {name!r} is stored packed, but {type(module).__name__} {path!r} "
                              f"does not quantize its {attr!r}: only a quantized layer's tensors are packed")


def _attach_tensors(gm: fx.GraphModule, doc: dict[str, Any], weights: dict[str, torch.Tensor], wpath: Path,
                    configured: set[int], version: int) -> None:
    """Attach parameters, buffers and constants, re-tying aliases; every stored tensor must be used and have
    the shape and dtype graph.json records, and a configured module's tensors those its config built."""
    made: dict[str, torch.Tensor] = {}
    used: set[str] = set()  # stored keys read (tensors and packed parts)
    decoded: dict[str, PackedTensor] = {}
    for i, e in enumerate(doc["tensors"]):
        name, kind, alias = e["name"], e["kind"], e.get("alias_of")
        *parents, attr = check_path(name, "tensors")
        owner = gm.get_submodule(".".join(parents))
        if alias is not None and alias not in made:
            raise CheckpointError(f"tensor {name!r} is an alias of unknown tensor {alias!r}")
        declared = getattr(owner, attr, None) if attr in (*owner._parameters, *owner._buffers) else None
        if id(owner) in configured and not isinstance(declared, torch.Tensor):
            raise CheckpointError(f"tensor {name!r}: module {type(owner).__name__} built from its config has "
                                  f"no {kind} {attr!r}")
        if "packed" in e and (version < 4 or alias is not None):
            raise CheckpointError(f"tensor {name!r}: packed records need schema 4 and cannot be aliases")
        if alias is not None:
            value = made[alias]
        elif "packed" in e:
            value, decoded[name] = decode_packed(name, e, weights, None if declared is None else
                                                 tuple(declared.shape), f"{wpath}: tensor {name!r}")
            used.update(e["packed"]["parts"].values())
        elif name not in weights:
            raise CheckpointError(f"{wpath}: tensor {name!r} is missing")
        else:
            value = from_stored(weights[name], e.get("dim_order"), e.get("shape"), f"{wpath}: tensor {name!r}")
            used.add(name)
        if isinstance(declared, torch.Tensor) and id(owner) in configured \
                and (tuple(declared.shape), declared.dtype) != (tuple(value.shape), value.dtype):
            raise CheckpointError(f"{wpath}: tensor {name!r} is {tuple(value.shape)} {value.dtype}, its module "
                                  f"declares {tuple(declared.shape)} {declared.dtype}")
        _check_record(i, e, value, wpath, version)
        if kind == "parameter":
            if not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=bool(e.get("requires_grad", True)))
            owner.register_parameter(attr, value)
        elif kind == "buffer":
            owner.register_buffer(attr, value, persistent=bool(e.get("persistent", True)))
        elif kind == "constant" and id(owner) not in configured and not any(
                attr in d for d in (owner._parameters, owner._buffers, owner._modules)) \
                and isinstance(getattr(owner, attr, value), torch.Tensor):
            setattr(owner, attr, value)
        else:
            raise CheckpointError(f"tensor {name!r}: bad kind {kind!r} or it clashes with an attribute")
        made[name] = value
        source = decoded.get(alias if alias is not None else name)
        if source is not None:  # the layer keeps the record, so saving it unchanged stores the same bytes
            for p in packers():
                p.loaded(owner, attr, source)
    unused = sorted(set(weights) - used)
    if unused:
        raise CheckpointError(f"{wpath}: holds tensors graph.json does not mention: {unused[:5]}")
    _check_packed_uses(gm, {e["name"]: decoded[e.get("alias_of") or e["name"]] for e in doc["tensors"]
                            if (e.get("alias_of") or e["name"]) in decoded}, wpath)
    for mname, mod in gm.named_modules(remove_duplicate=False):
        for tname, t in (*mod._parameters.items(), *mod._buffers.items(), *vars(mod).items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                raise CheckpointError(f"{wpath}: no value for {join(mname, tname)!r} (module built without it)")


def _target(gm: fx.GraphModule, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The object a node calls or names, through the allowlist only (strings for non-call ops)."""
    if op == "call_function":
        targets.check_call(target, args, kwargs)
        return targets.resolve_function(target)
    if op == "call_method":
        return targets.check_method(target)
    if op in ("call_module", "get_attr"):
        *parents, attr = check_path(target, "target")
        owner = gm.get_submodule(".".join(parents))
        tensors = (owner._parameters, owner._buffers) if op == "get_attr" else ()
        if attr in owner._modules or any(attr in d for d in tensors) or \
                (op == "get_attr" and isinstance(vars(owner).get(attr), torch.Tensor)):
            return target
        raise CheckpointError(f"{target!r} is not a stored {'tensor or ' if op == 'get_attr' else ''}module")
    if op == "placeholder" and isinstance(target, str) and is_identifier(target.lstrip("*")) \
            and len(target) - len(target.lstrip("*")) <= 2:
        return target
    if op == "output" and target == "output":
        return target
    raise CheckpointError(f"bad {op} target {target!r}"[:300])


def _codegen(graph: fx.Graph, codegen: Any, version: int) -> None:
    """Restore the graph's calling convention from fxforge's structure schema (schema 1 translated)."""
    if not isinstance(codegen, dict) or codegen.get("kind") not in ("default", "pytree"):
        raise CheckpointError(f"unknown codegen {codegen!r}"[:200])
    if codegen["kind"] == "default":
        if set(codegen) != {"kind"}:
            raise CheckpointError("default codegen takes no other keys")
        return
    if set(codegen) != {"kind", "orig_args", "in_spec", "out_spec"}:
        raise CheckpointError("pytree codegen needs exactly kind, orig_args, in_spec, out_spec")
    orig_args = codegen["orig_args"]
    if not isinstance(orig_args, list) or not all(is_identifier(a) and a != "self" for a in orig_args):
        raise CheckpointError("codegen orig_args must be identifiers")
    specs: dict[str, TreeSpec | None] = {}
    for key in ("in_spec", "out_spec"):
        doc = codegen[key]
        if doc is not None and version == 1:
            doc = translate_v1_spec(doc, f"codegen {key} (schema 1)")
        specs[key] = None if doc is None else decode_spec(doc, f"codegen {key}")
    in_spec = specs["in_spec"]
    if in_spec is None:  # torch's generated forward() flattens its arguments through it
        raise CheckpointError("pytree codegen needs an in_spec")
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(orig_args), in_spec, specs["out_spec"]))


def _build_graph(gm: fx.GraphModule, doc: dict[str, Any], version: int) -> fx.Graph:
    """Recreate every node with ``graph.create_node`` and restore the pytree calling convention."""
    graph, env, reach = fx.Graph(), Env(), StoredReach(gm)
    if not isinstance(doc["nodes"], list):
        raise CheckpointError("'nodes' must be a list")
    for entry in doc["nodes"]:
        if not isinstance(entry, dict):
            raise CheckpointError("each node must be a JSON object")
        name, op, target = entry.get("name"), entry.get("op"), entry.get("target")
        where, kwargs = f"node {name!r}"[:120], entry.get("kwargs", {})
        name = check_node_name(name, where)
        if not isinstance(op, str) or not isinstance(target, str) or not isinstance(kwargs, dict) \
                or not all(is_identifier(k) for k in kwargs):
            raise CheckpointError(f"{where}: malformed node (names and keywords must be identifiers)")
        stack = check_module_stack(entry["module_stack"], where) if "module_stack" in entry else None
        args = decode_value(entry.get("args", []), where, env)
        if not isinstance(args, list):
            raise CheckpointError(f"{where}: args must be a list")
        kwargs = {k: decode_value(v, where, env) for k, v in kwargs.items()}
        try:
            fn = _target(gm, op, target, tuple(args), kwargs)
            if "schema" in entry:  # recorded for ops outside aten/prims since schema 3 (older ones have none)
                targets.check_op_schema(fn, entry["schema"])
            node = graph.create_node(op, fn, tuple(args), kwargs, name=name)
            reach.add(node)  # what the node can reach: never a write to a stored tensor, never a module value
        except (CheckpointError, AttributeError) as exc:
            raise CheckpointError(f"{where} ({op} {target!r}): {exc}"[:600]) from None
        if node.name != name:
            raise CheckpointError(f"{where}: name is taken or reserved (became {node.name!r})")
        env[("node", name)] = node
        if stack:  # the capture's module stack (report/hierarchy groups by it), with class names as strings
            node.meta["nn_module_stack"] = {(p if all(p != q for q, _ in stack[:k]) else f"{p}#{k}"): (p, c)
                                            for k, (p, c) in enumerate(stack)}
    _codegen(graph, doc["codegen"], version)
    return graph


def _restore_metadata(graph: fx.Graph, doc: Any, mpath: Path) -> None:
    """Attach NodeMeta from metadata.json; record types must already be registered (by the passes that
    define them, which ``import fxforge`` imports): an unknown record is an error naming it."""
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if type(version) is not int or version != METADATA_SCHEMA_VERSION or not isinstance(doc.get("nodes"), dict):
        raise CheckpointError(f"{mpath}: metadata schema version {version!r} is not {METADATA_SCHEMA_VERSION}")
    nodes = {n.name: n for n in graph.nodes}
    for name, data in doc["nodes"].items():
        if name not in nodes:
            raise CheckpointError(f"{mpath}: metadata for unknown node {name!r}"[:300])
        try:
            meta = NodeMeta.from_json(data)
        except Exception as exc:
            raise CheckpointError(f"{mpath}: node {name!r}: bad metadata ({type(exc).__name__}: {exc}); import "
                                  "the module that registers its records"[:600]) from None
        set_meta(nodes[name], meta)


def reference_outputs(path: str | Path, expected_sha256: str | None = None) -> dict[str, torch.Tensor] | None:
    """The outputs recorded at export (manifest-verified), or None when the checkpoint recorded none."""
    root = Path(path)
    payloads, _ = read_verified(root, FORMAT, READABLE_VERSIONS, (GRAPH, METADATA, WEIGHTS), (INPUTS, OUTPUTS),
                                expected_sha256)
    return _parse(root, OUTPUTS, payloads) if OUTPUTS in payloads else None


def load_checkpoint(path: str | Path, expected_sha256: str | None = None) -> ForgeGraph:
    """Load a checkpoint written by :func:`save_checkpoint`; CheckpointError names the failing file.

    The manifest is verified first and every target is resolved through the allowlist, so loading
    never runs code the checkpoint chose. Nothing is returned unless every step succeeded. The manifest
    proves integrity only (anyone can re-hash edited files); ``expected_sha256``, the manifest digest
    its publisher printed with ``fxforge verify``, proves it is that very checkpoint.
    """
    from .forge_graph import ForgeGraph, PassRecord

    root = Path(path)
    payloads, version = read_verified(root, FORMAT, READABLE_VERSIONS, (GRAPH, METADATA, WEIGHTS), (INPUTS, OUTPUTS),
                                      expected_sha256)
    gpath = root / GRAPH
    doc = _parse(root, GRAPH, payloads)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("schema_version") != version \
            or type(doc.get("schema_version")) is not int:
        raise CheckpointError(f"{gpath}: not an fxforge graph of schema version {version} (as its manifest says)")
    check_graph_size(doc, str(gpath))  # before anything is built
    weights, input_tensors = _parse(root, WEIGHTS, payloads), _parse(root, INPUTS, payloads)
    try:
        class_name, frontend = doc["class_name"], doc["frontend"]
        if not is_identifier(class_name) or frontend not in ("fx", "export"):
            raise CheckpointError(f"bad class name {class_name!r} or frontend {frontend!r}"[:300])
        gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
        configured = _build_modules(gm, doc)
        _attach_tensors(gm, doc, weights, root / WEIGHTS, configured, version)
        graph = _build_graph(gm, doc, version)
        gm.graph = graph  # recompiles: the code is generated from checked identifiers and allowlisted nodes only
        graph.lint()
        gm.train(bool(doc["training"]))
        for module_path, flag in doc["training_exceptions"].items():
            gm.get_submodule(".".join(check_path(module_path, "training flags"))).training = bool(flag)
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
        raise CheckpointError(f"{gpath}: malformed checkpoint graph ({type(exc).__name__}: {exc})"[:800]) from None
    _restore_metadata(graph, _parse(root, METADATA, payloads), root / METADATA)
    return ForgeGraph.from_parts(gm, frontend, example_inputs, history, notes)
