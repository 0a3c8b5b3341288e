"""The data an HTML report shows, gathered from a ForgeGraph's typed metadata (no HTML here).

Per node: kind, op, target, shapes, dtypes, precision, and any software records (quantization,
LoRA, sparsity, profile figures...) that passes attached. Per quantized node: format, bits per role and,
when the graph can run on its example inputs, the SQNR measured by quantization_report_analysis_pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..graph.forge_graph import ForgeGraph
from ..graph.ir import classify
from ..graph.metadata import ValueMeta, get_meta, has_meta
from .overlays import node_precision

__all__ = ["NodeRow", "QuantRow", "node_rows", "quant_rows"]

ROLES = ("data_in", "weight", "bias", "data_out")


@dataclass(frozen=True)
class NodeRow:
    """One line of the node table."""

    name: str
    kind: str
    op: str
    target: str
    in_shapes: str
    out_shapes: str
    dtypes: str
    precision: str
    sparsity: str
    profile: str
    records: str


@dataclass(frozen=True)
class QuantRow:
    """One quantized node: its format, bit width per role and SQNR (dB) when measured."""

    name: str
    op: str
    format: str
    bits: dict[str, int] = field(default_factory=dict)
    sqnr_db: float | None = None


def _tensors(values: dict[str, ValueMeta]) -> list[ValueMeta]:
    return [v for v in values.values() if v.type == "tensor"]


def _shapes(values: dict[str, ValueMeta]) -> str:
    return " ".join(str(list(v.shape or ())) for v in _tensors(values))


def _find(records: dict[str, Any], words: tuple[str, ...]) -> str:
    """Fields of any record whose name or field name contains one of ``words``, compactly."""
    parts = []
    for rname, payload in records.items():
        if not isinstance(payload, dict):
            continue
        if any(w in rname for w in words):
            parts.append(f"{rname.split('.')[-1]}: " + json.dumps(payload, separators=(",", ":"))[:120])
            continue
        for key, value in payload.items():
            if any(w in key for w in words) and isinstance(value, int | float):
                parts.append(f"{key}={value:.4g}")
    return "; ".join(parts)


def node_rows(mg: ForgeGraph) -> list[NodeRow]:
    """One row per node of ``mg`` in graph order (shapes need the metadata passes to have run)."""
    rows = []
    for node in mg.nodes:
        target = str(node.target)
        if has_meta(node):
            meta = get_meta(node)
            common, records = meta.common, meta.software.to_json()
            kind, op = common.kind.value, common.op
            ins = {k: v for k, v in common.args.items() if k.startswith("data_in")}
            outs = _tensors(common.results)
            dtypes = " ".join(sorted({v.dtype or "" for v in outs}))
            precision = node_precision(node)[0]  # a quantized node's format and widths, not its fp32 carrier
            in_shapes, out_shapes = _shapes(ins), _shapes(common.results)
        else:
            kind_enum, op = classify(node, mg.model)
            kind, records = kind_enum.value, {}
            in_shapes = out_shapes = dtypes = precision = ""
        rows.append(NodeRow(node.name, kind, op, target, in_shapes, out_shapes, dtypes, precision,
                            _find(records, ("sparsity", "prun")), _find(records, ("profile", "latency", "flops")),
                            ", ".join(k.split(".")[-1] for k in records)))
    return rows


def _measured_sqnr(mg: ForgeGraph) -> tuple[dict[str, float], str]:
    """SQNR per node on the example inputs, or an empty dict and the reason it could not be measured."""
    if mg.example_inputs is None:
        return {}, "SQNR not measured: the graph has no example inputs"
    from ..passes import quantization_report_analysis_pass

    history = list(mg.history)
    try:
        _, info = quantization_report_analysis_pass(mg)
    except Exception as exc:  # noqa: BLE001 - the report still shows formats and bits
        return {}, f"SQNR not measured: {str(exc).splitlines()[0][:200]}"
    finally:
        mg.history[:] = history  # looking at a graph must not change its recorded history
    return {r["node"]: r["sqnr_db"] for r in info["nodes"]}, (
        f"SQNR on the example inputs; model output SQNR {info['output_sqnr_db']:.2f} dB")


def quant_rows(mg: ForgeGraph) -> tuple[list[QuantRow], str]:
    """Quantized nodes (empty when none) and a note on how SQNR was obtained."""
    from ..passes.quantize.records import QuantizationRecord

    found = []
    for node in mg.nodes:
        rec = get_meta(node).software.get(QuantizationRecord) if has_meta(node) else None
        if rec is not None:
            bits = {r: int(rec.config[f"{r}_width"]) for r in ROLES
                    if r in rec.quantizers and isinstance(rec.config.get(f"{r}_width"), int)}
            found.append((node.name, rec.op, rec.format, bits))
    if not found:
        return [], ""
    sqnr, note = _measured_sqnr(mg)
    return [QuantRow(n, op, fmt, bits, sqnr.get(n)) for n, op, fmt, bits in found], note
