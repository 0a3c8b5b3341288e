"""The typed result of ``sensitivity_analysis_pass``: how much the loss grows when one layer is quantized to a
candidate width, or one prune group (attention heads, FFN units) is pruned at a candidate ratio.

Shared by the pass (passes/analysis/sensitivity.py) and the search spaces' ``prior="sensitivity"``
(search/priors.py), which read it without re-running the measurement; ``to_json`` / ``from_json`` let a
study store it (plain JSON, every value checked on the way back in: a study's attributes are hostile input).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..contract import PassInfo
from ..select import parse_selector_fields

__all__ = ["METHODS", "GroupSensitivity", "LayerSensitivity", "SensitivityArgs", "SensitivityInfo"]

METHODS = ("fisher", "hessian_trace", "sqnr", "loss")
Method = Literal["fisher", "hessian_trace", "sqnr", "loss"]


@dataclass(frozen=True)
class SensitivityArgs:
    """data: calibration batches (mappings of inputs, with ``labels`` where the loss needs them), by reference;
    method: ``fisher`` (empirical Fisher: squared gradients x squared quantization/pruning perturbation),
    ``hessian_trace`` (Hutchinson estimate of each layer's Gauss-Newton block trace x mean squared perturbation,
    HAWQ-V3), ``sqnr`` (signal-to-quantization-noise ratio of each layer's output, loss-free; reported as a
    loss-like score that grows with the noise), ``loss`` (the calibration loss measured with each layer alone
    quantized, minus the float model's: no estimate, one forward pass over the batches per layer and width);
    widths / prune_ratios: the candidates measured; format: the fxforge
    quantization format whose ``width`` is varied; targets / exclude: selectors of the layers measured (default
    every Linear; only layers with a weight of two or more dimensions are measured);
    loss_fn: ``(output, batch) -> loss`` (default: the output's ``loss``, else cross-entropy on logits vs
    ``batch["labels"]``); num_batches: use only the first n batches; probes: Hutchinson probes per batch;
    format_params: the weight's other parameters of ``format`` (default: ``frac_width "auto"`` for integer,
    the format's defaults otherwise)."""

    data: Any = None
    method: Method = "fisher"
    widths: tuple[int, ...] = (2, 3, 4, 6, 8)
    prune_ratios: tuple[float, ...] = (0.25, 0.5, 0.75)
    format: str = "integer"
    targets: Any = None
    loss_fn: Any = None
    num_batches: int | None = None
    probes: int = 4
    seed: int = 0
    format_params: dict[str, Any] | None = None
    exclude: Any = None

    def __post_init__(self) -> None:
        parse_selector_fields(self)  # one meaning of a selector (and of an empty one) in every pass


@dataclass(frozen=True)
class LayerSensitivity:
    """One quantizable layer (``name``: the graph node's name, as quantize configs ``by: name`` select it):
    its weight's element count and the estimated loss increase at each candidate width, widest first."""

    name: str
    params: int
    quant: tuple[tuple[int, float], ...]

    def delta(self, width: int) -> float:
        """The estimated loss increase at ``width`` (KeyError naming the widths measured otherwise)."""
        for w, d in self.quant:
            if w == width:
                return d
        raise KeyError(f"layer {self.name!r}: width {width} was not measured (measured {[w for w, _ in self.quant]})")


@dataclass(frozen=True)
class GroupSensitivity:
    """One prune group: ``kind`` "heads" (an attention block's heads) or "ffn" (an FFN's hidden units),
    ``name`` the module path the pruning passes use, ``unit_scores`` each head's / unit's importance (higher:
    keep), ``prune`` the estimated loss increase when the least important ``ratio`` of units is removed;
    ``layers`` the module paths of the Linears whose rows form the units (q/k/v; an FFN's up / gate layers)."""

    name: str
    kind: Literal["heads", "ffn"]
    units: int
    unit_scores: tuple[float, ...]
    prune: tuple[tuple[float, float], ...]
    layers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SensitivityInfo(PassInfo):
    """The pass's result: per layer and per prune group, loss increase per candidate (larger: more sensitive)."""

    method: str
    baseline_loss: float
    layers: tuple[LayerSensitivity, ...]
    groups: tuple[GroupSensitivity, ...] = ()

    def ranking(self, width: int) -> list[str]:
        """Layer names, most sensitive first, at ``width``."""
        return [layer.name for layer in sorted(self.layers, key=lambda s: -s.delta(width))]

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "baseline_loss": self.baseline_loss,
                "layers": [{"name": s.name, "params": s.params, "quant": [list(p) for p in s.quant]}
                           for s in self.layers],
                "groups": [{"name": g.name, "kind": g.kind, "units": g.units, "unit_scores": list(g.unit_scores),
                            "prune": [list(p) for p in g.prune], "layers": list(g.layers)} for g in self.groups]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SensitivityInfo:
        """Read back ``to_json``'s form, checking every type and number (ValueError naming what is wrong)."""
        if not isinstance(data, Mapping):
            raise ValueError("sensitivity: expected a JSON object")
        method = data.get("method")
        if method not in METHODS:
            raise ValueError(f"sensitivity: method must be one of {list(METHODS)}")
        layers = tuple(LayerSensitivity(_name(s, "layer"), _count(s, "params"),
                                        tuple((_count(p, 0), _num(p, 1)) for p in _pairs(s, "quant")))
                       for s in _list(data, "layers"))
        groups = []
        for g in _list(data, "groups"):
            kind = g.get("kind")
            if kind not in ("heads", "ffn"):
                raise ValueError("sensitivity: a group's kind must be 'heads' or 'ffn'")
            scores = g.get("unit_scores")
            if not isinstance(scores, list) or not all(_finite(v) for v in scores):
                raise ValueError("sensitivity: unit_scores must be a list of finite numbers")
            layer_names = g.get("layers", [])
            if not isinstance(layer_names, list) or not all(isinstance(n, str) and 0 < len(n) <= 300
                                                            for n in layer_names):
                raise ValueError("sensitivity: a group's layers must be a list of names (strings of at most 300 "
                                 "characters)")
            groups.append(GroupSensitivity(_name(g, "group"), kind, _count(g, "units"), tuple(float(v) for v in scores),
                                           tuple((_num(p, 0), _num(p, 1)) for p in _pairs(g, "prune")),
                                           tuple(layer_names)))
        return cls(method=method, baseline_loss=_num(data, "baseline_loss"), layers=layers, groups=tuple(groups))


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _list(data: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ValueError(f"sensitivity: {key} must be a list of objects")
    return value


def _name(item: Mapping[str, Any], what: str) -> str:
    name = item.get("name")
    if not isinstance(name, str) or not name or len(name) > 300:
        raise ValueError(f"sensitivity: a {what} needs a name (a string of at most 300 characters)")
    return name


def _pairs(item: Mapping[str, Any], key: str) -> list[list[Any]]:
    value = item.get(key)
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise ValueError(f"sensitivity: {key} must be a list of [candidate, loss increase] pairs")
    return value


def _num(item: Any, key: Any) -> float:
    value = item[key] if isinstance(item, list) else item.get(key)
    if not _finite(value):
        raise ValueError(f"sensitivity: {key!r} must be a finite number")
    return float(value)


def _count(item: Any, key: Any) -> int:
    value = item[key] if isinstance(item, list) else item.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"sensitivity: {key!r} must be a non-negative integer")
    return value
