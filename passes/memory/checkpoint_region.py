"""CheckpointRegion: a contiguous piece of a graph run under ``torch.utils.checkpoint`` (recomputed in backward).

The region holds the piece as its own small fx graph over its children ``m0, m1, ...``, which are the very
module objects the piece called (aliases: their parameters keep their names where they already live, and a
checkpoint stores them once, as module aliases). Children that hold no tensor are rebuilt from their config.
With grad enabled the region runs ``checkpoint(body, *inputs, use_reentrant=False, preserve_rng_state=True)``:
only its inputs are kept for backward, its internals are recomputed with the RNG state of the forward, so
random ops replay the same draws; F.dropout (nn.Dropout) keeps its mask as bits instead of redrawing it
(passes/memory/dropout_tape.py: the CPU draw dominated a recomputed dropout's cost). Without grad (eval,
metadata passes) the body simply runs. Under torch.compile the region is a plain checkpoint (no tape: a mode
mutated inside the checkpoint breaks dynamo's graph): dynamo traces it as a checkpointed region, AOTAutograd's
partitioner recomputes it in backward and replays its random ops from the RNG state it saved in forward. The
rewrite engine's unused-module clean-up (passes/rewrite.delete_unused_submodules) keeps the aliased layers at
their own paths. A ``selective`` region keeps the results of its matrix multiplies and attention kernels
(``SAVED_OPS``) and recomputes only the rest, eager or compiled (torch.utils.checkpoint's selective activation
checkpointing; random ops replay the forward's RNG state, no dropout tape); ``selective="attention"`` keeps only
its fused attention kernels' results (``ATTENTION_OPS``: the costliest op of a long sequence per byte it returns)
and recomputes its linears too.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ...graph import targets
from ...graph.checkpoint import _codegen_json, _node_json
from ...graph.checkpoint_load import CHECKPOINT_SCHEMA_VERSION, _build_graph, _check_config
from .dropout_tape import DropoutTape

__all__ = ["ATTENTION_OPS", "SAVED_OPS", "CheckpointRegion", "KeptStorages", "Selective", "is_selective", "kept_ops"]

Selective = bool | Literal["attention"]  # False: full recomputation; True: keep SAVED_OPS; "attention": ATTENTION_OPS


class CheckpointRegion(nn.Module):
    """Runs ``graph`` (``inputs`` placeholders; output: one value or a tuple) under non-reentrant checkpointing."""

    recomputed_in_backward = True  # the "activation-checkpointed" graph property (passes/contract.py)

    def __init__(self, graph: fx.Graph, children: dict[str, nn.Module], inputs: int, selective: Selective = False
                 ) -> None:
        super().__init__()
        if not is_selective(selective):
            raise ValueError(f"CheckpointRegion: selective must be true, false or 'attention', got {selective!r}")
        for name, child in children.items():
            self.add_module(name, child)
        self.inputs = inputs
        self.selective = selective
        self._graph = graph
        self._body: tuple[tuple[int, ...], fx.GraphModule] | None = None
        self.body()  # built now: torch.compile cannot trace building a GraphModule (a graph break per region)

    def body(self) -> fx.GraphModule:
        """The graph as a GraphModule over the current children (rebuilt when a child was replaced, e.g. by
        a checkpoint's module aliases or a copy)."""
        key = tuple(id(m) for m in self._modules.values())
        if self._body is None or self._body[0] != key:
            self._body = (key, fx.GraphModule(self, self._graph, class_name="CheckpointRegionBody"))
        return self._body[1]

    def forward(self, *args: Any) -> Any:
        if len(args) != self.inputs:
            raise TypeError(f"CheckpointRegion takes {self.inputs} inputs, got {len(args)}")
        body, inputs = self.body(), args
        if self.selective and torch.is_grad_enabled():  # the policy's results kept, the rest recomputed
            return torch.utils.checkpoint.checkpoint(
                body, *inputs, use_reentrant=False, preserve_rng_state=True,
                context_fn=_save_heavy_results if self.selective is True else _save_attention_results)
        if torch.compiler.is_compiling():  # dynamo traces the checkpoint into a region AOTAutograd recomputes
            return torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False, preserve_rng_state=True)
        if torch.is_grad_enabled():
            if self.training and _has_dropout(self._graph, self):  # a tape per call: the forward's masks as bits
                return torch.utils.checkpoint.checkpoint(DropoutTape().run, body, *inputs, use_reentrant=False,
                                                         preserve_rng_state=True)
            return torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False, preserve_rng_state=True)
        return body(*inputs)

    def extra_repr(self) -> str:
        nodes = [n for n in self._graph.nodes if n.op not in ("placeholder", "output")]
        return (f"inputs={self.inputs}, nodes={len(nodes)}, first={nodes[0].name}, last={nodes[-1].name}"
                + ("" if not self.selective else ", selective" if self.selective is True else
                   f", selective={self.selective}"))


# what a selective region keeps: the results of matrix multiplies (linears) and fused attention kernels (the
# costly ops); every other op is recomputed in backward (torch.utils.checkpoint's selective activation
# checkpointing). Batched multiplies (bmm) are left out: in an unfused attention they make the sequence x
# sequence scores, the largest activations a region exists to drop. An "attention" region keeps only the fused
# attention kernels' results (output and log-sum-exp: a few MB for milliseconds of work at a long sequence) and
# recomputes its linears, so it fits where keeping every linear's result does not (the zoo GPT at T = 1024).
ATTENTION_OPS = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                           torch.ops.aten._scaled_dot_product_flash_attention.default,
                           torch.ops.aten._scaled_dot_product_efficient_attention.default,
                           torch.ops.aten._scaled_dot_product_cudnn_attention.default})
SAVED_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default}) | ATTENTION_OPS


def is_selective(value: Any) -> bool:
    """Whether ``value`` is a selective mode: exactly True, False or "attention"."""
    return value is True or value is False or (isinstance(value, str) and value == "attention")


def kept_ops(selective: Selective) -> frozenset[Any]:
    """The ops whose results a region in this mode keeps (none for full recomputation)."""
    return SAVED_OPS if selective is True else ATTENTION_OPS if selective == "attention" else frozenset()


class KeptStorages(TorchDispatchMode):
    """Collects the result storages of ``ops`` calls while active (what a selective region in that mode keeps)."""

    def __init__(self, ops: frozenset[Any] = SAVED_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    self.record(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return out

    def record(self, ptr: int, size: int) -> None:
        self.storages[ptr] = size


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_heavy_results() -> tuple[Any, Any]:
    """The selective region's context pair (a fresh one per call, as torch.utils.checkpoint asks)."""
    return create_selective_checkpoint_contexts(_policy)


def _save_attention_results() -> tuple[Any, Any]:
    """The same for a region keeping only its attention kernels' results."""
    return create_selective_checkpoint_contexts(_attention_policy)


def _has_dropout(graph: fx.Graph, owner: nn.Module) -> bool:
    """Whether the region calls F.dropout (directly or through an nn.Dropout child) or an attention that may drop
    out (F.scaled_dot_product_attention with a dropout_p that is not a literal 0, or a module wrapping it with
    one above 0), so a DropoutTape pays."""
    def drops(n: fx.Node) -> bool:
        if n.op == "call_function":
            p = n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)
            return n.target is F.dropout or (n.target is F.scaled_dot_product_attention
                                             and not (isinstance(p, float | int) and p == 0))
        if n.op == "call_module":
            module = owner.get_submodule(str(n.target))
            return type(module) is nn.Dropout or (getattr(module, "fxforge_op", None) == "scaled_dot_product_attention"
                                                  and getattr(module, "dropout_p", 0.0) > 0)
        return False

    return any(drops(n) for n in graph.nodes)


def _to_config(region: CheckpointRegion) -> dict[str, Any]:
    """The body as checkpoint JSON (same allowlist as the parent graph); tensor-free children by config."""
    body = region.body()
    tensor_names = {n for n, _ in body.named_parameters()} | {n for n, _ in body.named_buffers()}
    rebuilt: dict[str, Any] = {}
    for name, child in region.named_children():
        if next(iter((*child.parameters(), *child.buffers())), None) is None:
            spec = targets.module_spec_for(child)
            rebuilt[name] = {"class": spec.name, "config": None if spec.to_config is None else spec.to_config(child)}
    config = {"inputs": region.inputs, "children": list(region._modules), "rebuilt": rebuilt,
              "codegen": _codegen_json(region._graph),
              "nodes": [_node_json(n, body, tensor_names) for n in region._graph.nodes]}
    if getattr(region, "selective", False):  # only when set: full regions (and stages, stored alike) unchanged
        config["selective"] = region.selective
    return config


def _from_config(config: dict[str, Any]) -> CheckpointRegion:
    """Rebuild from :func:`_to_config`'s JSON (hostile: every name and target goes through the allowlist).

    Children holding tensors start as empty placeholders; the checkpoint's module aliases put the real ones."""
    if set(config) - {"selective"} != {"inputs", "children", "rebuilt", "codegen", "nodes"}:
        raise targets.CheckpointError(f"CheckpointRegion config keys {sorted(config)} are not the expected ones")
    selective = config.get("selective", False)
    if not is_selective(selective):
        raise targets.CheckpointError("CheckpointRegion config: selective must be true, false or 'attention'")
    names, rebuilt, inputs = config["children"], config["rebuilt"], config["inputs"]
    if not isinstance(names, list) or not all(targets.is_identifier(n) for n in names) \
            or not isinstance(rebuilt, dict) or not set(rebuilt) <= set(names) \
            or not isinstance(inputs, int) or isinstance(inputs, bool) or inputs < 0:
        raise targets.CheckpointError("CheckpointRegion config: children, rebuilt or inputs malformed")
    children: dict[str, nn.Module] = {}
    for name in names:
        entry = rebuilt.get(name)
        if entry is None:
            children[name] = nn.Module()
            continue
        if not isinstance(entry, dict) or set(entry) != {"class", "config"}:
            raise targets.CheckpointError(f"CheckpointRegion child {name!r}: malformed entry")
        spec = targets.resolve_module(entry["class"])
        if spec.from_config is None:
            children[name] = spec.cls()
        else:
            children[name] = spec.from_config(_check_config(name, spec, entry["config"]))
        if type(children[name]) is not spec.cls:
            raise targets.CheckpointError(f"CheckpointRegion child {name!r}: {spec.name} built another class")
    region = CheckpointRegion(fx.Graph(), children, inputs, selective=selective)
    # _build_graph resolves call targets through get_submodule only, which any nn.Module has
    region._graph = _build_graph(cast(fx.GraphModule, region), {"nodes": config["nodes"], "codegen": config["codegen"]},
                                 CHECKPOINT_SCHEMA_VERSION)
    region._body = None  # the body built in __init__ ran the empty graph
    region.body()
    return region


targets.register_module(CheckpointRegion, _to_config, _from_config, name="fxforge.CheckpointRegion")
