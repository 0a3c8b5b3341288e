"""Adapter-only LoRA checkpoints: just the adapters (and the modules trained with them), applied to a fresh base.

A checkpoint is a directory::

    adapter_config.json          per adapted layer: name, shape, rank/alpha/dropout/init, base SHA-256;
                                 modules_to_save (modules trained fully, PEFT's name) and their
                                 parameter names ("extras")
    adapter_weights.safetensors  ``<layer>.lora_A``, ``<layer>.lora_B`` and the modules_to_save parameters
    manifest.json                SHA-256 and size of both files

``load_lora_adapters(fresh_graph, path)`` verifies the manifest, checks every adapted layer exists in
the graph with the same shape (and, by default, the same base weights the adapters were trained on),
then inserts adapters with the saved configuration and loads the weights with strict name and shape
matching. Everything is checked before the graph is touched. No pickle, no ``torch.load``.

An adapter holds its own trainable tensors only: the extras are exactly the parameters of the
modules_to_save, which insertion makes trainable (its ``trainable`` selection) and which never hold or
lie inside an adapted layer; the base fingerprint covers each adapted layer's weight and bias, always.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from torch import fx

from ..graph.atomic import MANIFEST, dumps_json, loads_json, read_verified, write_checkpoint_dir
from ..graph.forge_graph import ForgeGraph
from ..graph.targets import CheckpointError
from .transform.lora import LoraLinear, check_lora_hparams, insert_lora_adapter_transform_pass, lora_layers

__all__ = ["CONFIG", "MANIFEST", "WEIGHTS", "LoraCheckpointError", "load_lora_adapters", "save_lora_adapters"]

FORMAT = "fxforge-lora-adapter"
SCHEMA_VERSION = 2  # 2: modules_to_save; extras are their parameters only
CONFIG, WEIGHTS = "adapter_config.json", "adapter_weights.safetensors"
MAX_ALPHA = 1e6  # scaling = alpha / rank; beyond this an adapter is an attack or a bug, not a model
_LAYER_KEYS = ("name", "in_features", "out_features", "bias", "rank", "alpha", "dropout", "init", "base_sha256")


class LoraCheckpointError(CheckpointError):
    """An adapter checkpoint cannot be written, read or applied; the message names the file or layer."""


def base_fingerprint(module: nn.Linear) -> str:
    """SHA-256 of a Linear's weight and bias (bytes, dtype, shape): the base an adapter was trained on."""
    h = hashlib.sha256()
    for attr in ("weight", "bias"):
        t = getattr(module, attr)
        if t is not None:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _within(path: str, root: str) -> bool:
    """``path`` is the module ``root`` or lies inside it ("" is the whole model)."""
    return root == "" or path == root or path.startswith(root + ".")


def _kept_parameters(gm: nn.Module, kept: list[str]) -> list[str]:
    """Names of the parameters of the modules_to_save (what insertion makes trainable), in module order."""
    names: list[str] = []
    for path in kept:
        names += [f"{path}.{n}" for n, _ in gm.get_submodule(path).named_parameters() if f"{path}.{n}" not in names]
    return names


def trained_modules(gm: fx.GraphModule) -> list[str]:
    """The outermost modules whose parameters all train and that hold no LoRA adapter (nor lie in one):
    what insertion's ``trainable`` selection made trainable (e.g. the classifier head)."""
    adapted = [p for _, p, _ in lora_layers(gm)]
    kept: list[str] = []
    for path, module in gm.named_modules():
        params = list(module.parameters())
        if path and params and all(p.requires_grad for p in params) and not any(_within(path, k) for k in kept) \
                and not any(_within(a, path) or _within(path, a) for a in adapted):
            kept.append(path)
    return kept


def save_lora_adapters(graph: ForgeGraph, path: str | Path, include_trainable: bool = True,
                       modules_to_save: list[str] | None = None) -> Path:
    """Write the graph's LoRA adapters and, if ``include_trainable``, the modules trained with them.

    ``modules_to_save`` (module paths) defaults to :func:`trained_modules`; any other trainable
    parameter (e.g. an adapted layer's own bias) is refused: the checkpoint could not restore it.
    """
    gm = graph.model
    layers = lora_layers(gm)
    if not layers:
        raise LoraCheckpointError("the graph has no LoRA adapters to save: run insert_lora_adapter_transform_pass "
                                  "first (or save the fused graph with graph.export)")
    kept = [] if not include_trainable else trained_modules(gm) if modules_to_save is None else list(modules_to_save)
    problems = _kept_problems(gm, kept, [p for _, p, _ in layers])
    if problems:
        raise LoraCheckpointError(f"{path}: modules_to_save {problems[0]}")
    extras = _kept_parameters(gm, kept)
    saved = {id(m.lora_A) for _, _, m in layers} | {id(m.lora_B) for _, _, m in layers} | {
        id(gm.get_parameter(n)) for n in extras}
    stray = [n for n, p in gm.named_parameters() if p.requires_grad and id(p) not in saved]
    if include_trainable and stray:
        raise LoraCheckpointError(
            f"{path}: parameters {stray[:4]}{' ...' if len(stray) > 4 else ''} are trainable but neither a LoRA "
            "adapter nor in modules_to_save (whole modules kept trainable, insertion's 'trainable'): an adapter "
            "checkpoint could not restore them. Freeze them (requires_grad_(False)), keep their modules with "
            "'trainable' at insertion, save adapters alone (include_trainable=False) or the whole graph "
            "(graph.export)")
    tensors = {n: gm.get_parameter(n).detach().cpu().contiguous().clone() for n in extras}
    entries: list[dict[str, Any]] = []
    for _, name, m in layers:
        if any(e["name"] == name for e in entries):
            continue
        tensors[f"{name}.lora_A"] = m.lora_A.detach().cpu().contiguous().clone()
        tensors[f"{name}.lora_B"] = m.lora_B.detach().cpu().contiguous().clone()
        entries.append({"name": name, "in_features": m.in_features, "out_features": m.out_features,
                        "bias": m.base.bias is not None, "rank": m.rank, "alpha": m.alpha, "dropout": m.dropout_p,
                        "init": m.init, "base_sha256": base_fingerprint(m.base)})
    config = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "layers": entries, "modules_to_save": kept,
              "extras": extras, "history": [r.to_json() for r in graph.history]}
    files = {CONFIG: dumps_json(config, CONFIG), WEIGHTS: safetensors.torch.save(tensors, metadata={"format": "pt"})}
    return write_checkpoint_dir(path, files, FORMAT, SCHEMA_VERSION)  # atomic: old or new, never a mix


def _kept_problems(gm: nn.Module, kept: list[Any], adapted: list[str]) -> list[str]:
    """Why ``kept`` cannot be modules_to_save next to the ``adapted`` layers (empty: it can)."""
    problems: list[str] = []
    for i, path in enumerate(kept):
        if not isinstance(path, str) or not path:
            problems.append(f"entry {path!r} is not a module path")
        elif path in kept[:i]:
            problems.append(f"lists {path!r} twice")
        elif any(_within(path, a) or _within(a, path) for a in adapted):
            problems.append(f"{path!r} holds or lies inside an adapted layer: its weights are the frozen base")
        else:
            try:
                gm.get_submodule(path)
            except AttributeError:
                problems.append(f"{path!r}: no such module in the graph")
    return problems


def _read(root: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Verify the manifest, then parse the config and weights (nothing is parsed before its hash matches)."""
    try:
        payloads, _ = read_verified(root, FORMAT, (SCHEMA_VERSION,), (CONFIG, WEIGHTS))
        config = loads_json(payloads[CONFIG], str(root / CONFIG))
    except LoraCheckpointError:
        raise
    except CheckpointError as exc:
        raise LoraCheckpointError(str(exc)) from None
    try:
        weights = safetensors.torch.load(payloads[WEIGHTS])
    except Exception as exc:
        raise LoraCheckpointError(f"{root / WEIGHTS}: unreadable safetensors file ({exc})") from None
    bad = [k for k, t in weights.items() if not (t.is_floating_point() or t.is_complex()) or not bool(
        torch.isfinite(t).all())]
    if bad:
        raise LoraCheckpointError(f"{root / WEIGHTS}: tensors {sorted(bad)[:5]} are not finite floating-point values")
    return config, weights


def _check_config(config: Any, where: Path) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The config's adapted layers, modules_to_save and extras, each checked for type and range."""
    if not isinstance(config, Mapping) or config.get("format") != FORMAT \
            or config.get("schema_version") != SCHEMA_VERSION:
        raise LoraCheckpointError(f"{where}: not an fxforge LoRA adapter config of schema {SCHEMA_VERSION}")
    layers, kept, extras = config.get("layers"), config.get("modules_to_save"), config.get("extras")
    if not isinstance(layers, list) or not layers or not isinstance(kept, list) or not isinstance(extras, list) \
            or not all(isinstance(e, str) for e in (*kept, *extras)):
        raise LoraCheckpointError(f"{where}: 'layers' must be a non-empty list, 'modules_to_save' a list of module "
                                  "paths and 'extras' a list of parameter names")
    seen: set[str] = set()
    for entry in layers:
        if not isinstance(entry, Mapping) or sorted(entry) != sorted(_LAYER_KEYS) \
                or not isinstance(entry["name"], str) or not isinstance(entry["base_sha256"], str) \
                or not all(type(entry[k]) is int and entry[k] > 0 for k in ("in_features", "out_features")) \
                or type(entry["bias"]) is not bool:
            raise LoraCheckpointError(f"{where}: each layer needs exactly the keys {list(_LAYER_KEYS)} (positive int "
                                      "in/out_features, bool bias, str name and base_sha256)")
        name = entry["name"]
        if name in seen:
            raise LoraCheckpointError(f"{where}: layer {name!r} is listed twice")
        seen.add(name)
        try:
            check_lora_hparams(entry["rank"], entry["alpha"], entry["dropout"], entry["init"])
        except ValueError as exc:
            raise LoraCheckpointError(f"{where}: layer {name!r}: {exc}") from None
        if entry["rank"] > min(entry["in_features"], entry["out_features"]):
            raise LoraCheckpointError(f"{where}: layer {name!r}: rank {entry['rank']} exceeds the layer's smaller "
                                      f"dimension {min(entry['in_features'], entry['out_features'])}")
        if not math.isfinite(entry["alpha"]) or entry["alpha"] > MAX_ALPHA:
            raise LoraCheckpointError(f"{where}: layer {name!r}: alpha {entry['alpha']!r} is outside "
                                      f"(0, {MAX_ALPHA:g}]")
    return layers, kept, extras


def load_lora_adapters(graph: ForgeGraph, path: str | Path,
                       check_base: bool = True) -> tuple[ForgeGraph, dict[str, Any]]:
    """Insert the saved adapters into a copy of ``graph`` (a freshly captured base), load their weights and
    return that copy (as a transform pass does: ``graph`` itself is not changed).

    Strict: every saved layer must exist as an nn.Linear call_module of the same shape, every saved
    tensor must find its parameter (same shape and dtype) and vice versa; the extras are exactly the
    parameters of the modules_to_save, none of which holds or lies in an adapted layer. With
    ``check_base`` the base weights must be the ones the adapters were trained on (SHA-256). Trainable
    state is restored: adapters and modules_to_save trainable, everything else frozen.
    info = {"adapted", "modules_to_save", "extras"}.
    """
    root = Path(path)
    config, weights = _read(root)
    layers, kept, extras = _check_config(config, root / CONFIG)
    gm = graph.model
    nodes = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    problems = [f"modules_to_save {p}" for p in _kept_problems(gm, kept, [e["name"] for e in layers])]
    for e in layers:
        name = e["name"]
        module = gm.get_submodule(name) if name in nodes else None
        if isinstance(module, LoraLinear):
            problems.append(f"{name}: already has a LoRA adapter")
        elif not isinstance(module, nn.Linear):
            problems.append(f"{name}: no nn.Linear layer of that name in the graph")
        elif (module.in_features, module.out_features, module.bias is not None) != \
                (e["in_features"], e["out_features"], e["bias"]):
            problems.append(f"{name}: shape ({module.in_features}->{module.out_features}, bias "
                            f"{module.bias is not None}) differs from the adapter's ({e['in_features']}->"
                            f"{e['out_features']}, bias {e['bias']})")
        elif check_base and base_fingerprint(module) != e["base_sha256"]:
            problems.append(f"{name}: base weights differ from those the adapter was trained on "
                            "(load_lora_adapters(..., check_base=False) to apply it anyway)")
    if problems:
        raise LoraCheckpointError(f"{root}: cannot apply the adapters to this graph: " + "; ".join(problems[:5])
                                  + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    owned = _kept_parameters(gm, kept)
    if sorted(extras) != sorted(owned):
        odd, absent = sorted(set(extras) - set(owned)), sorted(set(owned) - set(extras))
        raise LoraCheckpointError(f"{root / CONFIG}: 'extras' must be exactly the parameters of modules_to_save "
                                  f"{kept[:5]} (an adapter holds only its own trainable tensors): {odd[:5]} are not "
                                  f"theirs{f', {absent[:5]} are missing' if absent else ''}")
    expected = {f"{e['name']}.{p}" for e in layers for p in ("lora_A", "lora_B")} | set(extras)
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise LoraCheckpointError(f"{root / WEIGHTS}: tensors do not match {CONFIG}: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for e in layers:
        dtype = gm.get_parameter(f"{e['name']}.weight").dtype  # checked above: an nn.Linear of that name
        wanted[f"{e['name']}.lora_A"] = ((e["rank"], e["in_features"]), dtype)
        wanted[f"{e['name']}.lora_B"] = ((e["out_features"], e["rank"]), dtype)
    for pname in extras:
        wanted[pname] = (tuple(gm.get_parameter(pname).shape), gm.get_parameter(pname).dtype)
    for key, (shape, dtype) in wanted.items():
        if (tuple(weights[key].shape), weights[key].dtype) != (shape, dtype):
            raise LoraCheckpointError(f"{root / WEIGHTS}: {key!r} is {tuple(weights[key].shape)} {weights[key].dtype}, "
                                      f"the graph expects {shape} {dtype}")

    groups: dict[tuple[Any, ...], list[str]] = {}
    for e in layers:
        groups.setdefault((e["rank"], float(e["alpha"]), float(e["dropout"]), e["init"]), []).append(e["name"])
    for i, ((rank, alpha, dropout, init), names) in enumerate(groups.items()):
        graph, _ = insert_lora_adapter_transform_pass(graph, {  # a new graph: the caller's is left as it was
            "rank": rank, "alpha": alpha, "dropout": dropout, "init": init, "freeze_rest": i == 0,
            "targets": {"regex": [re.escape(n) for n in names]},
            "trainable": {"name": kept} if kept and i == 0 else None})
    with torch.no_grad():
        for key, value in weights.items():
            p = graph.model.get_parameter(key)
            if p.shape != value.shape or p.dtype != value.dtype or not p.requires_grad:
                raise LoraCheckpointError(f"{root / WEIGHTS}: {key!r} ({tuple(value.shape)}, {value.dtype}) does "
                                          f"not fit the graph's trainable parameter ({tuple(p.shape)}, {p.dtype})")
            p.copy_(value)
    return graph, {"adapted": [e["name"] for e in layers], "modules_to_save": kept, "extras": extras}
