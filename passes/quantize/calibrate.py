"""calibrate_transform_pass: PTQ calibration of activation quantizers over a few batches.

It sets quantizer scales (module state), so it is a transform; ``calibrate_analysis_pass`` is its
former name, kept as an alias of the same registered pass (``get_pass`` resolves both).

The graph runs in eval mode with every quantizer turned into an observer (activations stay fp32,
as with PyTorch observers), so each quantizer sees the float distribution of its tensor. The range
is min-max (running extremes) or percentile (per-batch two-sided percentiles, averaged). Scaled
integer activation quantizers take their scale/zero point from it, fixed-point ones with
``frac_width: "auto"`` the largest fraction width that still covers it; every range (and the chosen
fraction width) is stored in a :class:`CalibrationRecord` on the quantized node's software metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...graph.forge_graph import ForgeGraph
from ...graph.json_values import jsonable
from ...graph.metadata import get_meta
from ..base import forge_pass
from ..batching import evaluating, iter_batches, run_batch
from ..contract import NumericalContract, PassInfo
from ..rewrite import complete_metadata
from .quantizer import Observer
from .records import CalibrationRecord
from .state import activation_quantizers, quantized_nodes

__all__ = ["calibrate_transform_pass", "calibrate_analysis_pass", "CalibrateArgs", "CalibrateInfo"]


@dataclass(frozen=True)
class CalibrateArgs:
    """data: an iterable of batches (dicts of kwargs, tuples of args or tensors); None uses the
    graph's example inputs. method: ``minmax`` or ``percentile``; percentile: e.g. 99.99 (two-sided);
    num_batches: stop after this many batches (None: all)."""

    data: Any = None
    method: Literal["minmax", "percentile"] = "minmax"
    percentile: float = 99.99
    num_batches: int | None = None

    def __post_init__(self) -> None:
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.num_batches is not None and self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1 or None, got {self.num_batches}")


@dataclass(frozen=True)
class CalibrateInfo(PassInfo):
    """batches run; observed: activation quantizers that saw data; scales_set: static scaled-integer
    quantizers whose scale was fixed; unseen: quantizers no batch reached; nodes: nodes given a record."""

    batches: int
    observed: int
    scales_set: int
    unseen: int
    nodes: int


def _values(t: torch.Tensor | None) -> float | list[float] | None:
    """A range tensor as JSON numbers (None for a bound never observed)."""
    return None if t is None else jsonable(t, tensor_values=True)


@forge_pass("transform", CalibrateArgs, info=CalibrateInfo, requires=("quantized",), ensures=("calibrated",),
            contract=NumericalContract("bounded", note="fixes static scales: the quantization error changes"),
            aliases=("calibrate_analysis_pass",))
def calibrate_transform_pass(graph: ForgeGraph, args: CalibrateArgs) -> tuple[ForgeGraph, CalibrateInfo]:
    """Calibrate every activation quantizer; returns how many quantizers got a range and a scale."""
    gm = graph.model
    owners = {path: (node, key) for node, rec in quantized_nodes(gm) for key, path in rec.quantizers.items()}
    quantizers = activation_quantizers(gm)
    if not quantizers:
        raise ValueError("the graph has no activation quantizers (only weights are quantized, or the layers are "
                         "lowered): nothing to calibrate; quantize activations first (quantize_transform_pass with "
                         "data_in_* keys)")
    for q in quantizers.values():
        q.observer = Observer(args.method, args.percentile, q.channel_axis if q.per_channel else None)
    batches = 0
    try:
        with evaluating(gm):
            for batch in iter_batches(graph, args.data, args.num_batches):
                run_batch(gm, batch)
                batches += 1
        if batches == 0:
            raise ValueError("calibration data is empty")
        records: dict[str, CalibrationRecord] = {}
        scaled = unseen = 0
        for path, q in quantizers.items():
            obs = q.observer
            assert obs is not None
            if obs.min is None:
                unseen += 1
                continue
            lo, hi = obs.range()
            q.set_range(lo, hi)
            scaled += int(q.needs_calibration)
            stats: dict[str, Any] = {"path": path, "min": _values(obs.min), "max": _values(obs.max),
                                     "lo": _values(lo), "hi": _values(hi), "numel": obs.numel}
            if q.fmt.scaled:
                stats.update(scale=_values(q.scale), zero_point=_values(q.zero_point))
            elif q.frac_width is not None:  # auto fixed point: the fraction width the range gave
                stats["frac_width"] = int(q.frac_width) if q.frac_width.dim() == 0 else q.frac_width.int().tolist()
            node, key = owners.get(path, (None, path))
            if node is None:
                continue
            rec = records.setdefault(node.name, CalibrationRecord(
                method=args.method, percentile=args.percentile if args.method == "percentile" else None,
                num_batches=batches))
            rec.stats[key] = stats
        nodes = {n.name: n for n in gm.graph.nodes}
        for name, rec in records.items():
            get_meta(nodes[name]).software.set(rec)
    finally:
        for q in quantizers.values():
            q.observer = None
    complete_metadata(gm)  # quantizers that could not run uncalibrated now can: record their values
    return graph, CalibrateInfo(batches=batches, observed=len(quantizers) - unseen, scales_set=scaled,
                                unseen=unseen, nodes=len(records))


calibrate_analysis_pass = calibrate_transform_pass
"""Former name of :func:`calibrate_transform_pass` (the same registered pass): calibration sets
quantizer scales, so it is a transform."""
