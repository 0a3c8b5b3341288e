"""What changed between two graphs (before / after a pipeline, or two checkpoints), as data (no HTML here).

A layer is a module a call_module node calls (or a weight a get_attr node reads). It changed when its
module class, canonical op, parameter or buffer shapes, values, or quantization format differ; what a
pass did to it (pruned, quantized, LoRA adapted or fused, lowered to a kernel) is read from the after
graph's typed metadata and masked-layer buffers. The summary counts parameters, weight bits, bytes on
disk (checkpoints only), profiled latency and accuracy where the caller knows it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph.forge_graph import ForgeGraph
from ..graph.metadata import MetaRecord, get_meta, has_meta

__all__ = ["Comparison", "LayerChange", "SideSummary", "compare_graphs"]

FUSE_LORA = "fuse_lora_weights_transform_pass"
WeightBits = Callable[[ForgeGraph], float]


@dataclass(frozen=True)
class LayerChange:
    """One layer that differs: what differs (``kinds``), what a pass did to it (``tags``) and node names."""

    path: str
    kinds: tuple[str, ...]
    tags: tuple[str, ...] = ()
    detail: str = ""
    nodes_a: tuple[str, ...] = ()
    nodes_b: tuple[str, ...] = ()


@dataclass(frozen=True)
class SideSummary:
    """The figures of one side; None where unknown (no checkpoint, no profile, no accuracy given)."""

    name: str
    nodes: int
    parameters: int
    nonzero_parameters: int
    weight_bits: float | None = None
    bytes_on_disk: int | None = None
    latency_ms: float | None = None
    accuracy: float | None = None
    passes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """Before (``a``) and after (``b``): their summaries and every changed layer in graph order."""

    a: SideSummary
    b: SideSummary
    layers: tuple[LayerChange, ...] = field(default_factory=tuple)
    graphs: tuple[ForgeGraph, ForgeGraph] | None = field(default=None, repr=False, compare=False)

    def changed_layers(self) -> set[str]:
        """Paths of the layers that differ."""
        return {c.path for c in self.layers}

    def tagged(self, tag: str) -> set[str]:
        """Paths whose tags start with ``tag`` (``pruned``, ``quantized``, ``LoRA``, ``LoRA fused``, ``lowered``)."""
        return {c.path for c in self.layers if any(t.startswith(tag) for t in c.tags)}

    def _repr_html_(self) -> str:
        from .compare import comparison_html
        from .notebook import framed

        return framed(comparison_html(self))


def _layers(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Layer path -> node names using it, in graph order: call_module targets and get_attr weights."""
    out: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str):
            out.setdefault(node.target, []).append(node.name)
    return out


def _record(gm: fx.GraphModule, nodes: list[str], cls: type[MetaRecord]) -> MetaRecord | None:
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in nodes:
        node = by_name[name]
        if has_meta(node):
            rec = get_meta(node).software.get(cls)
            if rec is not None:
                return rec
    return None


def _op(gm: fx.GraphModule, nodes: list[str]) -> str:
    by_name = {n.name: n for n in gm.graph.nodes}
    ops = {get_meta(by_name[n]).common.op for n in nodes if has_meta(by_name[n])}
    return ",".join(sorted(ops))


def _state(gm: fx.GraphModule, path: str) -> dict[str, torch.Tensor]:
    value = _owner(gm, path)
    if isinstance(value, nn.Module):
        return {k: v.detach() for k, v in value.state_dict().items()}
    return {"": value.detach()} if isinstance(value, torch.Tensor) else {}


def _tensor_kinds(sa: dict[str, torch.Tensor], sb: dict[str, torch.Tensor]) -> tuple[list[str], str]:
    kinds, notes = [], []
    if set(sa) != set(sb):
        kinds.append("params")
        added, gone = sorted(set(sb) - set(sa)), sorted(set(sa) - set(sb))
        notes += [f"+{added[:4]}" if added else "", f"-{gone[:4]}" if gone else ""]
    shared = sorted(set(sa) & set(sb))
    reshaped = [k for k in shared if sa[k].shape != sb[k].shape]
    if reshaped:
        kinds.append("shape")
        notes += [f"{k or 'tensor'} {list(sa[k].shape)}->{list(sb[k].shape)}" for k in reshaped[:3]]
    differ = [k for k in shared if k not in reshaped and (sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k]))]
    if differ and "params" not in kinds:
        kinds.append("params")
    if differ:
        notes.append(f"values differ: {differ[:4]}")
    return kinds, "; ".join(n for n in notes if n)


def _tags(gm_a: fx.GraphModule, gm_b: fx.GraphModule, path: str, nodes_a: list[str], nodes_b: list[str],
          b_fused_lora: bool, changed: bool) -> list[str]:
    """What a pass did to the after graph's layer ``path``, from its metadata records and module type."""
    from ..passes.prune.modules import is_masked
    from ..passes.quantize.records import LoweringRecord, QuantizationRecord
    from ..passes.transform.lora import LoraRecord

    tags: list[str] = []
    try:
        module: nn.Module | None = gm_b.get_submodule(path)
    except AttributeError:
        module = None
    if module is not None and is_masked(module):
        mask = getattr(module, "weight_mask", None)
        share = 1.0 - float(mask.float().mean()) if isinstance(mask, torch.Tensor) and mask.numel() else 0.0
        tags.append(f"pruned {share:.0%}")
    quant = _record(gm_b, nodes_b, QuantizationRecord)
    if isinstance(quant, QuantizationRecord):
        bits = quant.config.get("weight_width")
        tags.append(f"quantized {quant.format}" + (f" w{bits}" if isinstance(bits, int) else ""))
    lora_b, lora_a = _record(gm_b, nodes_b, LoraRecord), _record(gm_a, nodes_a, LoraRecord)
    if isinstance(lora_b, LoraRecord):
        tags.append(f"LoRA r={lora_b.rank}")
    elif changed and (lora_a is not None or b_fused_lora) and _op(gm_b, nodes_b) == "linear":
        tags.append("LoRA fused")
    lowered = _record(gm_b, nodes_b, LoweringRecord)
    if isinstance(lowered, LoweringRecord):
        tags.append(f"lowered {lowered.kernel}")
    return tags


def _format(gm: fx.GraphModule, nodes: list[str]) -> str:
    from ..passes.quantize.records import QuantizationRecord

    rec = _record(gm, nodes, QuantizationRecord)
    if not isinstance(rec, QuantizationRecord):
        return ""
    widths = {k: v for k, v in sorted(rec.config.items()) if k.endswith("_width")}
    return f"{rec.format} {widths}"


def layer_changes(a: ForgeGraph, b: ForgeGraph) -> list[LayerChange]:
    """Every layer of ``a`` or ``b`` that differs, in ``b``'s graph order (then ``a``'s removed layers)."""
    gm_a, gm_b = a.model, b.model
    la, lb = _layers(gm_a), _layers(gm_b)
    fused = any(r.name == FUSE_LORA for r in b.history[len(a.history):]) or (
        any(r.name == FUSE_LORA for r in b.history) and not any(r.name == FUSE_LORA for r in a.history))
    out = []
    for path in [*lb, *(p for p in la if p not in lb)]:
        if path not in la or path not in lb:
            kind = "added" if path in lb else "removed"
            out.append(LayerChange(path, (kind,), (), "", tuple(la.get(path, ())), tuple(lb.get(path, ()))))
            continue
        kinds, detail = _tensor_kinds(_state(gm_a, path), _state(gm_b, path))
        ta, tb = type(_owner(gm_a, path)).__name__, type(_owner(gm_b, path)).__name__
        if ta != tb:
            kinds.append("type")
            detail = "; ".join(x for x in (f"{ta} -> {tb}", detail) if x)
        if _op(gm_a, la[path]) != _op(gm_b, lb[path]):
            kinds.append("op")
        fa, fb = _format(gm_a, la[path]), _format(gm_b, lb[path])
        if fa != fb:
            kinds.append("format")
            detail = "; ".join(x for x in (detail, f"format {fa or 'float'} -> {fb or 'float'}") if x)
        tags = _tags(gm_a, gm_b, path, la[path], lb[path], fused, bool(kinds))
        if kinds:
            out.append(LayerChange(path, tuple(kinds), tuple(tags), detail, tuple(la[path]), tuple(lb[path])))
    return out


def _owner(gm: fx.GraphModule, path: str) -> object:
    try:
        return gm.get_submodule(path)
    except AttributeError:
        owner, _, attr = path.rpartition(".")
        return getattr(gm.get_submodule(owner) if owner else gm, attr, None)


def _weight_file_bytes(checkpoint: str | Path) -> int:
    """Bytes of the checkpoint directory's weights file (what search's ``checkpoint_bytes`` measures)."""
    from ..graph.checkpoint_load import WEIGHTS

    path = Path(checkpoint) / WEIGHTS
    if not path.is_file():
        raise ValueError(f"{checkpoint}: no checkpoint weights file {WEIGHTS}")
    return path.stat().st_size


def summarize(mg: ForgeGraph, name: str, checkpoint: str | Path | None = None, accuracy: float | None = None,
              weight_bits: WeightBits | None = None) -> SideSummary:
    """The summary of one side (``checkpoint``: its directory, for the bytes its weights take on disk;
    ``weight_bits``: how to count the graph's weight bits, e.g. fxforge.search.objectives.weight_bits)."""
    from ..passes.analysis.profile import ProfileRecord

    params = list(mg.model.parameters())
    latencies = [rec.latency_ms for n in mg.nodes if has_meta(n)
                 for rec in [get_meta(n).software.get(ProfileRecord)] if rec is not None]
    return SideSummary(
        name=name, nodes=sum(1 for _ in mg.nodes), parameters=sum(p.numel() for p in params),
        nonzero_parameters=sum(int(torch.count_nonzero(p.detach())) for p in params),
        weight_bits=None if weight_bits is None else float(weight_bits(mg)),
        bytes_on_disk=None if checkpoint is None else _weight_file_bytes(checkpoint),
        latency_ms=sum(latencies) if latencies else None, accuracy=accuracy,
        passes=tuple(r.name for r in mg.history))


def compare_graphs(a: ForgeGraph, b: ForgeGraph, names: tuple[str, str] = ("before", "after"),
                   checkpoints: tuple[str | Path | None, str | Path | None] = (None, None),
                   accuracy: tuple[float | None, float | None] = (None, None),
                   weight_bits: WeightBits | None = None) -> Comparison:
    """Compare ``a`` (before) with ``b`` (after): summaries and the changed layers. ``weight_bits`` counts a
    graph's weight bits (report/ builds on passes only, so the counter is given: the CLI passes search's)."""
    return Comparison(summarize(a, names[0], checkpoints[0], accuracy[0], weight_bits),
                      summarize(b, names[1], checkpoints[1], accuracy[1], weight_bits), tuple(layer_changes(a, b)),
                      (a, b))
