"""gptq_transform_pass: data-aware weight rounding (GPTQ) inside fxforge's own quantized layers.

The graph is quantized by ``quantize_transform_pass`` with the same config, so the result has exactly its
layer types, quantizers and records (it packs, lowers and checkpoints like any quantized graph). Then, for
each quantized Linear, H = 2XᵀX/N is accumulated from the layer's real inputs over the calibration batches
(quantizers off: the float graph's activations; all layers from one run, not layer by layer) and the float
weight is replaced by its GPTQ rounding on the layer's own grid (``gptq_solver``). The layer re-quantizes
that weight in its forward and gets it back unchanged (bit for bit for the block formats).

Weight formats: ``integer`` (fixed or ``auto`` fraction width), ``scaled_integer`` (per tensor or per channel,
symmetric or not) and ``minifloat`` on a grid fixed from the float weight; block formats (``mxint``,
``block_fp``, ``mxfp``) with each block's shared exponent fixed from the block's current, error-updated
values when the sweep first reaches one of its columns (with ``act_order``, the first in the permuted order),
as GPTQ fixes group-wise scales (``gptq_grid``). Blocks run along the inputs GPTQ sweeps (a block is
``block_size`` consecutive columns); a block along the outputs lies in one column and is fixed with it.
Functional linears (``F.linear`` after fuse_kernels) are rounded too when their input is quantized (its
data_in quantizer is where the input is read). Conv layers, layers wrapped by another module (LoRA) and functional
linears without a data_in quantizer keep round-to-nearest and are listed in ``skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import PassArgsError, forge_pass
from ..batching import evaluating, iter_batches, run_batch
from ..contract import NumericalContract, PassInfo
from .config import QuantizeConfig
from .gptq_grid import column_quantizer, weight_grid
from .gptq_solver import gptq_round, reconstruction_error
from .modules import QuantizedLinear
from .quantizer import Quantize
from .state import quantized_nodes
from .state import quantizers as all_quantizers
from .transform import quantize_transform_pass

__all__ = ["gptq_transform_pass", "GptqArgs", "GptqInfo", "column_quantizer"]

@dataclass(frozen=True)
class GptqArgs:
    """config: the MASE quantization config (as for quantize_transform_pass; any weight format, block formats
    included); data: calibration batches (None: the example inputs); num_batches: stop after this many; damp:
    fraction of mean(diag H) added to the diagonal; block: columns between two lazy updates (speed only, not
    the format's block_size); act_order: quantize high-energy inputs first (a format block's exponent is fixed
    when the first of its columns in that order is reached)."""

    config: dict[str, Any] = field(default_factory=dict)
    data: Any = None
    num_batches: int | None = None
    damp: float = 0.01
    block: int = 128
    act_order: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.damp <= 1.0:
            raise ValueError(f"damp must be in [0, 1], got {self.damp}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}")
        if self.num_batches is not None and self.num_batches < 1:
            raise ValueError(f"num_batches must be >= 1 or None, got {self.num_batches}")


@dataclass(frozen=True)
class GptqInfo(PassInfo):
    """layers: per GPTQ-rounded Linear, the relative output error on the calibration inputs of GPTQ and of
    round-to-nearest (``{"gptq": .., "rtn": ..}``); skipped: quantized layers left at round-to-nearest, with
    the reason; batches: calibration batches run; quantized_nodes: as quantize_transform_pass reports."""

    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    batches: int = 0
    quantized_nodes: int = 0


@dataclass(frozen=True)
class _Target:
    """One linear GPTQ rounds: its float weight, the weight's quantizer, and the module whose call sees its input
    (the quantized layer itself, or the data_in quantizer of a functional ``linear``)."""

    weight: torch.Tensor  # the parameter itself (rounded in place)
    quantizer: Quantize
    sees_input: nn.Module


def _linear_layers(gm: fx.GraphModule) -> tuple[dict[str, _Target], dict[str, str]]:
    """The quantized linears GPTQ rounds (weight owner's path -> target) and the ones it leaves (path -> why)."""
    chosen: dict[str, _Target] = {}
    skipped: dict[str, str] = {}
    for path, module in gm.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if not isinstance(wq, Quantize):
            continue
        if isinstance(module, QuantizedLinear):
            chosen[path] = _Target(module.weight, wq, module)
        else:
            skipped[path] = f"{type(module).__name__}: GPTQ rounds Linear layers only (round-to-nearest kept)"
    for node, rec in quantized_nodes(gm):  # functional linears (fused kernels): F.linear(q_in(x), q_w(W))
        if node.op != "call_function" or rec.op != "linear" or "weight_1" not in rec.quantizers:
            continue
        wq = gm.get_submodule(rec.quantizers["weight_1"])
        q_node = node.args[1]
        source = q_node.args[0] if isinstance(q_node, fx.Node) and q_node.args else None
        if not isinstance(wq, Quantize) or not isinstance(source, fx.Node) or source.op != "get_attr":
            skipped[node.name] = "functional linear whose weight is not a parameter (round-to-nearest kept)"
            continue
        owner = str(source.target).rsplit(".", 1)[0]
        if "data_in_0" not in rec.quantizers:
            skipped[owner] = ("functional linear without a data_in quantizer to read its input from "
                              "(round-to-nearest kept)")
            continue
        chosen[owner] = _Target(gm.get_parameter(str(source.target)), wq,
                                gm.get_submodule(rec.quantizers["data_in_0"]))
    return chosen, skipped


def _hessians(graph: ForgeGraph, layers: dict[str, _Target], args: GptqArgs) -> tuple[dict[str, torch.Tensor], int]:
    """H = 2XᵀX/N per layer from its float inputs over the calibration batches (every quantizer off)."""
    gm = graph.model
    sums = {p: torch.zeros(t.weight.shape[1], t.weight.shape[1], dtype=torch.float64) for p, t in layers.items()}
    counts = dict.fromkeys(layers, 0)
    handles = []
    for path, target in layers.items():
        def hook(_m: nn.Module, inputs: tuple[Any, ...], _out: Any, path: str = path) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            sums[path] += x.T @ x
            counts[path] += x.shape[0]
        handles.append(target.sees_input.register_forward_hook(hook))
    qs = list(all_quantizers(gm).values())
    was = [q.enabled for q in qs]
    batches = 0
    try:
        for q in qs:
            q.enabled = False
        with evaluating(gm):
            for batch in iter_batches(graph, args.data, args.num_batches):
                run_batch(gm, batch)
                batches += 1
    finally:
        for h in handles:
            h.remove()
        for q, e in zip(qs, was):
            q.enabled = e
    return {p: 2.0 * sums[p] / max(counts[p], 1) for p in layers if counts[p] > 0}, batches


# the same graph states refused as quantize_transform_pass (it runs inside this pass)
@forge_pass("transform", GptqArgs, info=GptqInfo, forbids=quantize_transform_pass.spec.forbids,
            ensures=("metadata", "quantized"),
            contract=NumericalContract("bounded", note="quantized weights: GPTQ rounding, error reported per "
                                                       "layer next to round-to-nearest's"))
def gptq_transform_pass(graph: ForgeGraph, args: GptqArgs) -> tuple[ForgeGraph, GptqInfo]:
    """Quantize ``graph`` with ``config`` as quantize_transform_pass does, with GPTQ-rounded Linear weights."""
    try:
        QuantizeConfig.from_dict(args.config)
    except ValueError as exc:
        raise PassArgsError(f"gptq_transform_pass: config: {exc}") from None
    graph, qinfo = quantize_transform_pass.apply_inplace(graph, args.config)
    layers, skipped = _linear_layers(graph.model)
    if not layers:
        raise PassArgsError("gptq_transform_pass: the config quantizes no Linear weight; give the linears a "
                            "weight format, e.g. {'linear': {'config': {'name': 'mxint', 'weight_width': 4}}} or "
                            f"{{'name': 'integer', 'weight_width': 4, 'weight_frac_width': 'auto'}}; skipped: "
                            f"{skipped}")
    hessians, batches = _hessians(graph, layers, args)
    if batches == 0:
        raise ValueError("gptq_transform_pass: calibration data is empty; pass {'data': [batch, ...]}")
    report: dict[str, dict[str, float]] = {}
    for path, target in layers.items():
        h = hessians.get(path)
        if h is None:
            skipped[path] = "no calibration batch reached it (round-to-nearest kept)"
            continue
        w = target.weight.detach()
        grid, groups = weight_grid(target.quantizer, w.shape)
        q = gptq_round(w, h, grid, groups, damp=args.damp, block=args.block, act_order=args.act_order)
        with torch.no_grad():
            rtn = target.quantizer(w)
        report[path] = {"gptq": reconstruction_error(w, q, h), "rtn": reconstruction_error(w, rtn, h)}
        with torch.no_grad():
            target.weight.copy_(q)
    return graph, GptqInfo(layers=report, skipped=skipped, batches=batches, quantized_nodes=qinfo.quantized_nodes)

