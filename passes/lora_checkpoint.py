"""Adapter-only LoRA checkpoints: just the adapters (and other trained parameters), applied to a fresh base.

A checkpoint is a directory::

    adapter_config.json          per adapted layer: name, shape, rank/alpha/dropout/init, base SHA-256;
                                 names of the extra trained parameters (e.g. the classifier head)
    adapter_weights.safetensors  ``<layer>.lora_A``, ``<layer>.lora_B`` and the extra parameters
    manifest.json                SHA-256 and size of both files

``load_lora_adapters(fresh_graph, path)`` verifies the manifest, checks every adapted layer exists in
the graph with the same shape (and, by default, the same base weights the adapters were trained on),
then inserts adapters with the saved configuration and loads the weights with strict name and shape
matching. Everything is checked before the graph is touched. No pickle, no ``torch.load``.
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

from ..graph.atomic import MANIFEST, dumps_json, loads_json, read_verified, write_checkpoint_dir
from ..graph.forge_graph import ForgeGraph
from ..graph.targets import CheckpointError
from .transform.lora import LoraLinear, check_lora_hparams, insert_lora_adapter_transform_pass, lora_layers

__all__ = ["CONFIG", "MANIFEST", "WEIGHTS", "LoraCheckpointError", "load_lora_adapters", "save_lora_adapters"]

FORMAT = "fxforge-lora-adapter"
SCHEMA_VERSION = 1
CONFIG, WEIGHTS = "adapter_config.json", "adapter_weights.safetensors"
MAX_ALPHA = 1e6  # scaling = alpha / rank; beyond this an adapter is an attack or a bug, not a model
_LAYER_KEYS = ("name", "in_features", "out_features", "bias", "rank", "alpha", "dropout", "init", "base_sha256")


class LoraCheckpointError(CheckpointError):
    """An adapter checkpoint cannot be written, read or applied; the message names the file or layer."""


def base_fingerprint(module: nn.Linear, skip: frozenset[str] = frozenset()) -> str:
    """SHA-256 of a Linear's weight and bias (bytes, dtype, shape), minus the ``skip`` names (saved ones)."""
    h = hashlib.sha256()
    for attr in ("weight", "bias"):
        t = getattr(module, attr)
        if t is not None and attr not in skip:
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _saved_base(layer: str, extras: list[str]) -> frozenset[str]:
    """Base tensors of ``layer`` stored as trained extras (e.g. a trained bias): not part of the fingerprint."""
    return frozenset(a for a in ("weight", "bias") if f"{layer}.base.{a}" in extras)


def save_lora_adapters(graph: ForgeGraph, path: str | Path, include_trainable: bool = True) -> Path:
    """Write the graph's LoRA adapters (+ every other trainable parameter if ``include_trainable``)."""
    gm = graph.model
    layers = lora_layers(gm)
    if not layers:
        raise LoraCheckpointError("the graph has no LoRA adapters to save: run insert_lora_adapter_transform_pass "
                                  "first (or save the fused graph with graph.export)")
    tensors: dict[str, torch.Tensor] = {}
    owned = {id(p) for _, _, m in layers for p in (m.lora_A, m.lora_B)}
    extras: list[str] = []
    if include_trainable:
        for pname, p in gm.named_parameters():
            if p.requires_grad and id(p) not in owned:
                tensors[pname] = p.detach().cpu().contiguous().clone()
                extras.append(pname)
    entries: list[dict[str, Any]] = []
    for _, name, m in layers:
        if any(e["name"] == name for e in entries):
            continue
        tensors[f"{name}.lora_A"] = m.lora_A.detach().cpu().contiguous().clone()
        tensors[f"{name}.lora_B"] = m.lora_B.detach().cpu().contiguous().clone()
        entries.append({"name": name, "in_features": m.in_features, "out_features": m.out_features,
                        "bias": m.base.bias is not None, "rank": m.rank, "alpha": m.alpha, "dropout": m.dropout_p,
                        "init": m.init, "base_sha256": base_fingerprint(m.base, _saved_base(name, extras))})
    config = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "layers": entries, "extras": extras,
              "history": [r.to_json() for r in graph.history]}
    files = {CONFIG: dumps_json(config, CONFIG), WEIGHTS: safetensors.torch.save(tensors, metadata={"format": "pt"})}
    return write_checkpoint_dir(path, files, FORMAT, SCHEMA_VERSION)  # atomic: old or new, never a mix


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


def _check_config(config: Any, where: Path) -> tuple[list[dict[str, Any]], list[str]]:
    if not isinstance(config, Mapping) or config.get("format") != FORMAT \
            or config.get("schema_version") != SCHEMA_VERSION:
        raise LoraCheckpointError(f"{where}: not an fxforge LoRA adapter config of schema {SCHEMA_VERSION}")
    layers, extras = config.get("layers"), config.get("extras")
    if not isinstance(layers, list) or not layers or not isinstance(extras, list) \
            or not all(isinstance(e, str) for e in extras):
        raise LoraCheckpointError(f"{where}: 'layers' must be a non-empty list and 'extras' a list of names")
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
    return layers, extras


def load_lora_adapters(graph: ForgeGraph, path: str | Path,
                       check_base: bool = True) -> tuple[ForgeGraph, dict[str, Any]]:
    """Insert the saved adapters into a copy of ``graph`` (a freshly captured base), load their weights and
    return that copy (as a transform pass does: ``graph`` itself is not changed).

    Strict: every saved layer must exist as an nn.Linear call_module of the same shape, every saved
    tensor must find its parameter (same shape and dtype) and vice versa. With ``check_base`` the base
    weights must be the ones the adapters were trained on (SHA-256). Trainable state is restored:
    adapters and the saved extras trainable, everything else frozen. info = {"adapted", "extras"}.
    """
    root = Path(path)
    config, weights = _read(root)
    layers, extras = _check_config(config, root / CONFIG)
    gm = graph.model
    nodes = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    extra_set = set(extras)
    problems: list[str] = []
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
        elif check_base and base_fingerprint(module, _saved_base(name, extras)) != e["base_sha256"]:
            problems.append(f"{name}: base weights differ from those the adapter was trained on "
                            "(load_lora_adapters(..., check_base=False) to apply it anyway)")
    if problems:
        raise LoraCheckpointError(f"{root}: cannot apply the adapters to this graph: " + "; ".join(problems[:5])
                                  + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    expected = {f"{e['name']}.{p}" for e in layers for p in ("lora_A", "lora_B")} | extra_set
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise LoraCheckpointError(f"{root / WEIGHTS}: tensors do not match {CONFIG}: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]}")
    params = dict(gm.named_parameters())
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for e in layers:
        dtype = gm.get_submodule(e["name"]).weight.dtype
        wanted[f"{e['name']}.lora_A"] = ((e["rank"], e["in_features"]), dtype)
        wanted[f"{e['name']}.lora_B"] = ((e["out_features"], e["rank"]), dtype)
    for pname in extras:
        if pname in params:
            wanted[pname] = (tuple(params[pname].shape), params[pname].dtype)
        elif not any(pname.startswith(e["name"] + ".base.") for e in layers):
            raise LoraCheckpointError(f"{root / WEIGHTS}: the graph has no parameter {pname!r}")
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
            "targets": {"regex": [re.escape(n) for n in names]}})
    params = dict(graph.model.named_parameters())
    with torch.no_grad():
        for key, value in weights.items():
            p = params.get(key)
            if p is None or p.shape != value.shape or p.dtype != value.dtype:
                raise LoraCheckpointError(f"{root / WEIGHTS}: {key!r} ({tuple(value.shape)}, {value.dtype}) does "
                                          f"not fit the graph's parameter "
                                          f"{None if p is None else (tuple(p.shape), p.dtype)}")
            p.copy_(value)
            p.requires_grad_(True)
    return graph, {"adapted": [e["name"] for e in layers], "extras": extras}
