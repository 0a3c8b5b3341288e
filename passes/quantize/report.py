"""quantization_report_analysis_pass: per-node quantization error (SQNR) and average bit widths.

The quantized graph runs twice on the same batches under ``torch.fx.Interpreter``: as is, and as
the float reference (every quantizer disabled, which gives back the float model exactly since the
quantized layers keep fp32 parameters), or against an explicit ``baseline`` graph with the same
node names. For each quantized node the output after its ``data_out`` quantizer is compared with the
float output of the same node: ``SQNR = 10 log10(sum ref^2 / sum (ref - q)^2)`` in dB, accumulated
over batches (complex outputs compare real and imaginary parts). The error is end to end: it
includes what earlier quantized nodes contributed. Average bits are element-weighted: weight bits
over quantized parameters, activation bits over the activations the quantizers saw.

Each node with quantized weights also reports ``weight_zero_fraction``: the share of its nonzero weights
that quantize to exactly 0. Above one half (a fixed-point fraction width too coarse for the weights'
range) the node is listed in ``zeroed_weight_nodes`` and a :class:`QuantizationWarning` says what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import get_meta
from ..analysis.table import format_table
from ..base import forge_pass
from ..batching import evaluating, iter_batches
from ..contract import PassInfo
from ..metrics import signal_noise_power, sqnr_db
from ..propagate import flat_inputs
from .records import LoweringRecord
from .state import quantized_nodes, quantizers
from .zeroed import ZEROED_THRESHOLD, warn_zeroed, zero_counts

__all__ = ["quantization_report_analysis_pass", "QuantReportArgs", "QuantReportInfo", "sqnr_db",
           "quantizers_disabled", "format_report"]


@dataclass(frozen=True)
class QuantReportArgs:
    """data: batches as for calibration (None: example inputs); num_batches: cap; baseline: a float
    ForgeGraph to compare with (None: this graph with quantizers off); print_table: print a summary."""

    data: Any = None
    num_batches: int | None = None
    baseline: Any = None
    print_table: bool = False


@contextmanager
def quantizers_disabled(root: torch.nn.Module) -> Iterator[None]:
    """Temporarily turn every Quantize under ``root`` into the identity."""
    qs = list(quantizers(root).values())
    states = [q.enabled for q in qs]
    for q in qs:
        q.enabled = False
    try:
        yield
    finally:
        for q, s in zip(qs, states):
            q.enabled = s


class _Capture(fx.Interpreter):
    """Runs a graph and keeps the values of the named nodes."""

    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm)
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.keep:
            self.values[n.name] = out
        return out


def _output_node(node: fx.Node, quantizers: dict[str, str]) -> fx.Node:
    """The node carrying the quantized op's final value (its data_out quantizer, if inserted)."""
    out_path = quantizers.get("data_out")
    for user in node.users:
        if user.op == "call_module" and str(user.target) == out_path:
            return user
    return node


def _run(gm: fx.GraphModule, graph: ForgeGraph, batch: Any, keep: set[str]) -> dict[str, Any]:
    from ...graph.inputs import ExampleInputs

    example = batch if isinstance(batch, ExampleInputs) else ExampleInputs.coerce(batch)
    interp = _Capture(gm, keep | {"output"})
    interp.values["output"] = interp.run(*flat_inputs(gm, example))
    return interp.values


@dataclass(frozen=True)
class QuantReportInfo(PassInfo):
    """nodes: one row per quantized node {node, op, format, sqnr_db, <role>_bits, and weight_zero_fraction
    where weights are quantized}; output_sqnr_db: the model output's SQNR; average weight / activation bits
    (None when nothing of that kind is quantized); weight_zero_fraction: over all quantized weights (None
    without any); zeroed_weight_nodes: nodes where more than half of the nonzero weights quantize to 0."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    output_sqnr_db: float = 0.0
    avg_weight_bits: float | None = None
    avg_activation_bits: float | None = None
    batches: int = 0
    weight_zero_fraction: float | None = None
    zeroed_weight_nodes: list[str] = field(default_factory=list)


@forge_pass("analysis", QuantReportArgs, info=QuantReportInfo, requires=("quantized",))
def quantization_report_analysis_pass(graph: ForgeGraph, args: QuantReportArgs) -> tuple[ForgeGraph,
                                                                                         QuantReportInfo]:
    """Per-node SQNR (dB), model-output SQNR and average weight/activation bits."""
    gm = graph.model
    nodes = quantized_nodes(gm)
    if not nodes:
        raise ValueError("no node carries a quantization record (metadata re-initialised after quantizing?)")
    outputs = {n.name: _output_node(n, rec.quantizers).name for n, rec in nodes}
    baseline = args.baseline.model if isinstance(args.baseline, ForgeGraph) else args.baseline
    lowered = [n.name for n, _ in nodes if get_meta(n).software.get(LoweringRecord) is not None]
    if lowered and baseline is None:
        raise ValueError(f"nodes {lowered[:3]} run real int8 kernels, so disabling quantizers does not give the "
                         "float model back: pass {'baseline': <the float ForgeGraph>}")
    power = {name: [0.0, 0.0] for name in outputs}
    out_power = [0.0, 0.0]
    elems: dict[str, list[int]] = {}  # path -> [elements seen, calls]
    zeros: dict[str, list[int]] = {}  # weight quantizer path -> [nonzero weights quantized to 0, nonzero weights]
    counting = [True]
    all_quantizers = quantizers(gm)

    def count(path: str, weight: bool) -> Any:
        def hook(mod: torch.nn.Module, inp: tuple[Any, ...], out: Any) -> None:
            if counting[0] and isinstance(out, torch.Tensor):
                entry = elems.setdefault(path, [0, 0])
                entry[0] += out.numel() * (2 if out.is_complex() else 1)
                entry[1] += 1
                if weight and inp and isinstance(inp[0], torch.Tensor) and inp[0].shape == out.shape:
                    z = zeros.setdefault(path, [0, 0])
                    for i, n in enumerate(zero_counts(inp[0], out)):
                        z[i] += n
        return hook

    hooks = [q.register_forward_hook(count(path, q.is_param and q.role == "weight"))
             for path, q in all_quantizers.items()]
    batches = 0
    try:
        with evaluating(gm):
            for batch in iter_batches(graph, args.data, args.num_batches):
                counting[0] = True
                quant = _run(gm, graph, batch, set(outputs.values()))
                counting[0] = False
                if baseline is None:
                    with quantizers_disabled(gm):
                        ref = _run(gm, graph, batch, set(outputs))
                else:
                    baseline.eval()
                    ref = _run(baseline, graph, batch, set(outputs))
                for name, out_name in outputs.items():
                    if name in ref and out_name in quant:
                        s, n = signal_noise_power(ref[name], quant[out_name])
                        power[name][0] += s
                        power[name][1] += n
                s, n = signal_noise_power(ref["output"], quant["output"])
                out_power[0] += s
                out_power[1] += n
                batches += 1
    finally:
        for h in hooks:
            h.remove()
    if batches == 0:
        raise ValueError("report data is empty")
    table = []
    zeroed: list[tuple[str, float]] = []
    for node, rec in nodes:
        row: dict[str, Any] = {"node": node.name, "op": rec.op, "format": rec.format,
                               "sqnr_db": sqnr_db(*power[node.name])}
        for key, path in rec.quantizers.items():
            q = all_quantizers.get(path)
            if q is not None:
                row[f"{key}_bits"] = q.bits
        counts = [zeros[p] for p in rec.quantizers.values() if p in zeros]
        if counts:
            nonzero = sum(c[1] for c in counts)
            row["weight_zero_fraction"] = sum(c[0] for c in counts) / nonzero if nonzero else 0.0
            if row["weight_zero_fraction"] > ZEROED_THRESHOLD:
                zeroed.append((node.name, row["weight_zero_fraction"]))
        table.append(row)
    w_bits = w_elems = a_bits = a_elems = 0.0
    for path, (numel, calls) in elems.items():
        q = all_quantizers[path]
        if q.is_param:  # a parameter is quantized once per forward: count its size once
            w_bits += q.bits * numel / calls
            w_elems += numel / calls
        else:
            a_bits += q.bits * numel
            a_elems += numel
    nonzero_weights = sum(c[1] for c in zeros.values())
    info = QuantReportInfo(nodes=table, output_sqnr_db=sqnr_db(*out_power),
                           avg_weight_bits=w_bits / w_elems if w_elems else None,
                           avg_activation_bits=a_bits / a_elems if a_elems else None, batches=batches,
                           weight_zero_fraction=sum(c[0] for c in zeros.values()) / nonzero_weights
                           if nonzero_weights else None,
                           zeroed_weight_nodes=[name for name, _ in zeroed])
    warn_zeroed("quantization_report_analysis_pass", zeroed, stacklevel=4)
    if args.print_table:
        print(format_report(info))
    return graph, info


def format_report(info: QuantReportInfo) -> str:
    """A plain-text table of the report (the shared table formatter) and a summary line."""
    rows = [{"node": r["node"], "op": r["op"], "format": r["format"], "SQNR dB": f"{r['sqnr_db']:.2f}",
             "weights -> 0": "-" if r.get("weight_zero_fraction") is None else f"{r['weight_zero_fraction']:.0%}"}
            for r in info.nodes]
    bits = ["-" if b is None else f"{b:.2f}" for b in (info.avg_weight_bits, info.avg_activation_bits)]
    return (format_table(rows) + f"\nmodel output SQNR {info.output_sqnr_db:.2f} dB; average weight bits "
            f"{bits[0]}, activation bits {bits[1]}")
