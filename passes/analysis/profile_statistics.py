"""profile_statistics_analysis_pass: per-node weight and activation statistics over calibration batches.

MASE's config carries over: ``by`` (type | name | regex, the selector language's lookup), the nodes whose
weights (``target_weight_nodes``: their module's own parameters and buffers, read once) and activations
(``target_activation_nodes``: every tensor argument, and the results with ``profile_output_activation``)
are profiled, and the statistics for each (passes/analysis/statistics.py: min-max, variance, n-sigma and
quantile ranges, abs mean). Batches stream through the graph once each (eval, no grad) and only running
statistics are kept. Results go to each node's :class:`StatisticsRecord` under its software entry names
(``weight``, ``data_in_0``, ``data_out_0``) and to the info; MASE's ``input_generator`` is ``data`` here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.fx as fx

from ...graph.forge_graph import ForgeGraph
from ...graph.inputs import ExampleInputs
from ...graph.metadata import get_meta
from ..base import forge_pass
from ..batching import evaluating, iter_batches
from ..contract import PassInfo
from ..propagate import flat_inputs
from ..select import matches_by, node_identity
from .statistics import Statistic, StatisticsRecord, Values, make_statistic

__all__ = ["ProfileStatisticsArgs", "ProfileStatisticsInfo", "profile_statistics_analysis_pass"]

Stats = dict[str, dict[str, Values]]  # entry -> statistic -> result


def _names(value: tuple[str, ...] | str) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


@dataclass(frozen=True)
class ProfileStatisticsArgs:
    """MASE's keys: by, target_weight_nodes, target_activation_nodes (ops for ``by: type``, node or module
    names for ``by: name``), weight_statistics / activation_statistics (``{statistic: {option: value}}``),
    data (MASE: input_generator; default: the example inputs), num_samples (stop once that many samples
    have run; MASE's way), num_batches (stop after that many batches), profile_output_activation."""

    by: Literal["type", "name", "regex"] = "type"
    target_weight_nodes: tuple[str, ...] | str = ()
    target_activation_nodes: tuple[str, ...] | str = ()
    weight_statistics: dict[str, Any] = field(default_factory=lambda: {"range_min_max": {}})
    activation_statistics: dict[str, Any] = field(default_factory=lambda: {"range_min_max": {}})
    data: Any = None
    num_samples: int | None = None
    num_batches: int | None = None
    profile_output_activation: bool = False
    MASE_ALIASES: ClassVar[dict[str, str]] = {"input_generator": "data"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_weight_nodes", _names(self.target_weight_nodes))
        object.__setattr__(self, "target_activation_nodes", _names(self.target_activation_nodes))
        if not self.target_weight_nodes and not self.target_activation_nodes:
            raise ValueError("nothing to profile: give target_weight_nodes and/or target_activation_nodes, e.g. "
                             "{'by': 'type', 'target_weight_nodes': ['linear'], 'target_activation_nodes': ['relu']}")
        for key in ("weight_statistics", "activation_statistics"):
            config = getattr(self, key)
            for name, options in config.items():
                make_statistic(name, options or {})  # refuse a bad config before anything runs
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")


@dataclass(frozen=True)
class ProfileStatisticsInfo(PassInfo):
    """stats[node][entry][statistic] = {result: value} (as recorded in each node's StatisticsRecord);
    batches and samples run; the nodes profiled for weights and for activations."""

    stats: dict[str, Stats]
    batches: int
    samples: int
    weight_nodes: tuple[str, ...] = ()
    activation_nodes: tuple[str, ...] = ()

    def stat(self, node: str, entry: str, statistic: str) -> Values:
        """One result, e.g. ``info.stat("bert_encoder_layer_0_output_dense", "weight", "range_min_max")``."""
        return self.stats[node][entry][statistic]


def _collection(config: dict[str, Any]) -> dict[str, Statistic]:
    return {name: make_statistic(name, options or {}) for name, options in config.items()}


def _tensor_entries(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A node's tensor arguments under the common metadata's entry names (data_in_i, data_in_i_j, keyword)."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append((f"data_in_{i}", a))
        elif isinstance(a, list | tuple):
            out += [(f"data_in_{i}_{j}", x) for j, x in enumerate(a) if isinstance(x, torch.Tensor)]
    return out + [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]


def _results(value: Any) -> list[tuple[str, torch.Tensor]]:
    values = value if isinstance(value, list | tuple) else (value,)
    return [(f"data_out_{i}", v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]


class _Collector(fx.Interpreter):
    """Runs the graph, feeding the selected nodes' tensor inputs (and results) to their statistics."""

    def __init__(self, gm: fx.GraphModule, targets: set[fx.Node], config: dict[str, Any], outputs: bool) -> None:
        super().__init__(gm)
        self.targets, self.config, self.outputs = targets, config, outputs
        self.stats: dict[fx.Node, dict[str, dict[str, Statistic]]] = {}

    def _feed(self, node: fx.Node, entries: list[tuple[str, torch.Tensor]]) -> None:
        per_node = self.stats.setdefault(node, {})
        for entry, tensor in entries:
            if tensor.is_floating_point():
                for stat in per_node.setdefault(entry, _collection(self.config)).values():
                    stat.update(tensor)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.targets:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            self._feed(n, _tensor_entries(args, kwargs) + (_results(result) if self.outputs else []))
        return result


def _select(gm: fx.GraphModule, by: str, keys: tuple[str, ...], modules_only: bool) -> list[fx.Node]:
    out = []
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        if modules_only and node.op != "call_module":
            continue
        name, module, op = node_identity(node, gm)
        if any(matches_by(by, key, name, module, op) or node.name == key for key in keys):
            out.append(node)
    return out


def _samples(batch: Any) -> int:
    example = batch if isinstance(batch, ExampleInputs) else ExampleInputs.coerce(batch)
    tensors = [*example.args, *example.kwargs.values()]
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def _weights(gm: fx.GraphModule, nodes: list[fx.Node], config: dict[str, Any]) -> dict[fx.Node, Stats]:
    out: dict[fx.Node, Stats] = {}
    for node in nodes:
        module = gm.get_submodule(str(node.target))
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for entry, tensor in tensors:
            if tensor is None or not tensor.is_floating_point():
                continue
            stats = _collection(config)
            for stat in stats.values():
                stat.update(tensor)
            out.setdefault(node, {})[entry] = {name: stat.result() for name, stat in stats.items()}
    return out


@forge_pass("analysis", ProfileStatisticsArgs, info=ProfileStatisticsInfo, requires=("metadata",))
def profile_statistics_analysis_pass(graph: ForgeGraph,
                                     args: ProfileStatisticsArgs) -> tuple[ForgeGraph, ProfileStatisticsInfo]:
    """Stream calibration batches through the graph and record each selected node's statistics."""
    gm = graph.model
    weight_nodes = _select(gm, args.by, _names(args.target_weight_nodes), modules_only=True)
    act_nodes = _select(gm, args.by, _names(args.target_activation_nodes), modules_only=False)
    if not weight_nodes and not act_nodes:
        ops = sorted({node_identity(n, gm)[2] for n in gm.graph.nodes if n.op.startswith("call_")})
        raise ValueError(f"no node matches by={args.by!r} targets {list(args.target_weight_nodes)} / "
                         f"{list(args.target_activation_nodes)}; ops in this graph: {ops}")
    if act_nodes and args.num_samples is None and args.num_batches is None and isinstance(args.data, Iterator):
        raise ValueError("data is an iterator (it may never end): give num_samples (MASE's key) or num_batches")
    stats = _weights(gm, weight_nodes, args.weight_statistics)
    batches = samples = 0
    if act_nodes:
        collector = _Collector(gm, set(act_nodes), args.activation_statistics, args.profile_output_activation)
        with evaluating(gm):
            for batch in iter_batches(graph, args.data, args.num_batches):
                collector.run(*flat_inputs(gm, ExampleInputs.coerce(batch)))
                batches, samples = batches + 1, samples + _samples(batch)
                if args.num_samples is not None and samples >= args.num_samples:
                    break
        if not batches:
            raise ValueError("data gave no batch: pass {'data': [batch, ...]} (MASE: input_generator)")
        for node, collected in collector.stats.items():
            per_node = stats.setdefault(node, {})
            for entry, collection in collected.items():
                per_node[entry] = {name: stat.result() for name, stat in collection.items()}
    for node, entries in stats.items():
        get_meta(node).software.set(StatisticsRecord(stats=entries))
    return graph, ProfileStatisticsInfo(stats={n.name: s for n, s in stats.items()}, batches=batches,
                                        samples=samples, weight_nodes=tuple(n.name for n in weight_nodes),
                                        activation_nodes=tuple(n.name for n in act_nodes))
