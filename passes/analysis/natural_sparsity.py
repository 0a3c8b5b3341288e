"""add_natural_sparsity_metadata_analysis_pass (MASE's name): how many exact zeros the Linear / Conv layers see.

Per selected layer: the fraction of its effective weight that is exactly zero (a pruned layer's mask
counted, as MASE read the parametrized weight) and the fraction of exact zeros in its input activation over
the calibration batches (e.g. after a ReLU). Recorded as each node's :class:`NaturalSparsityRecord` and in the
info, with element-weighted averages. MASE recorded the fraction of *non-zeros* under the name
``natural_sparsity``; fxforge records zeros, so 0.0 means dense (docs/migration.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import MetaRecord, get_meta, register_record
from ..base import forge_pass
from ..batching import evaluating, iter_batches
from ..contract import PassInfo
from ..propagate import flat_inputs
from ..rewrite import NoMatchError, describe_candidates
from ..select import parse_selector_fields, select_nodes

__all__ = ["NaturalSparsityRecord", "NaturalSparsityArgs", "NaturalSparsityInfo",
           "add_natural_sparsity_metadata_analysis_pass"]

DEFAULT_TARGETS: dict[str, Any] = {"type": ["linear", "conv1d", "conv2d"]}


@register_record("software.natural_sparsity")
@dataclass
class NaturalSparsityRecord(MetaRecord):
    """Fractions of exact zeros: ``weight`` (effective weight) and ``activation`` (the layer's first input, over
    every calibration batch), with the element counts they were taken over."""

    weight: float = 0.0
    activation: float = 0.0
    weight_elements: int = 0
    activation_elements: int = 0


@dataclass(frozen=True)
class NaturalSparsityArgs:
    """targets / exclude: selectors over Linear / Conv layers (default: every one); data: calibration batches
    (MASE: ``dummy_in``, one batch; default: the example inputs); num_batches: stop after that many."""

    targets: Any = None
    exclude: Any = None
    data: Any = None
    num_batches: int | None = None
    MASE_ALIASES: ClassVar[dict[str, str]] = {"dummy_in": "data"}
    MASE_REFUSED: ClassVar[dict[str, str]] = {
        "add_meta": "the counts are always recorded in typed metadata (NaturalSparsityRecord)"}

    def __post_init__(self) -> None:
        parse_selector_fields(self)


@dataclass(frozen=True)
class NaturalSparsityInfo(PassInfo):
    """layers: module path -> its record; element-weighted averages over the layers; batches run."""

    layers: dict[str, NaturalSparsityRecord] = field(default_factory=dict)
    avg_weight: float = 0.0
    avg_activation: float = 0.0
    batches: int = 0


def _effective_weight(module: torch.nn.Module) -> torch.Tensor:
    masked = getattr(module, "masked_weight", None)
    weight = masked() if callable(masked) else getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"a {type(module).__name__} has no weight tensor")
    return weight.detach()


class _ZeroCounter(fx.Interpreter):
    """Runs the graph, counting exact zeros in the first tensor input of the selected nodes."""

    def __init__(self, gm: fx.GraphModule, nodes: set[fx.Node]) -> None:
        super().__init__(gm)
        self.nodes = nodes
        self.zeros: dict[fx.Node, list[int]] = {n: [0, 0] for n in nodes}

    def run_node(self, n: fx.Node) -> Any:
        if n in self.nodes:
            args, _ = self.fetch_args_kwargs_from_env(n)
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None:
                self.zeros[n][0] += int((x == 0).sum())
                self.zeros[n][1] += x.numel()
        return super().run_node(n)


def _average(pairs: list[tuple[float, int]]) -> float:
    total = sum(n for _, n in pairs)
    return sum(f * n for f, n in pairs) / total if total else 0.0


@forge_pass("analysis", NaturalSparsityArgs, info=NaturalSparsityInfo, requires=("metadata",))
def add_natural_sparsity_metadata_analysis_pass(graph: ForgeGraph,
                                                args: NaturalSparsityArgs) -> tuple[ForgeGraph, NaturalSparsityInfo]:
    """Count exact zeros in the selected layers' weights and input activations; record them per node."""
    gm = graph.model
    targets = DEFAULT_TARGETS if args.targets is None else args.targets
    nodes = {name: node for node, name, m, _ in select_nodes(gm, targets, args.exclude, modules_only=True)
             if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)}
    if not nodes:
        raise NoMatchError(f"no Linear / Conv layer matched targets={targets!r} exclude={args.exclude!r}; "
                           f"candidates: {describe_candidates(gm)}")
    counter = _ZeroCounter(gm, set(nodes.values()))
    batches = 0
    with evaluating(gm):
        for batch in iter_batches(graph, args.data, args.num_batches):
            counter.run(*flat_inputs(gm, ExampleInputs.coerce(batch)))
            batches += 1
    if batches == 0:
        raise ValueError("data gave no batch: pass {'data': [batch, ...]} (MASE: dummy_in) or leave it out to use "
                         "the example inputs")
    layers: dict[str, NaturalSparsityRecord] = {}
    for path, node in nodes.items():
        weight = _effective_weight(gm.get_submodule(path))
        zeros, seen = counter.zeros[node]
        rec = NaturalSparsityRecord(float((weight == 0).sum()) / max(weight.numel(), 1),
                                    zeros / seen if seen else 0.0, weight.numel(), seen)
        get_meta(node).software.set(rec)
        layers[path] = rec
    recs = list(layers.values())
    return graph, NaturalSparsityInfo(layers, _average([(r.weight, r.weight_elements) for r in recs]),
                                      _average([(r.activation, r.activation_elements) for r in recs]), batches)
