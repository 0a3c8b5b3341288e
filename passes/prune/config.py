"""MASE's pruning config, validated: ``{"weight": {...}, "activation": {...}}`` sections.

Each section takes ``sparsity`` (a fraction in [0, 1)), ``method`` (``random`` | ``l1`` | ``l2`` |
``taylor`` | ``movement``; MASE's ``l1-norm`` / ``l2-norm`` spellings are accepted; ``movement`` reads the
scores add_movement_metadata_analysis_pass recorded during training, passes/prune/movement.py), ``scope``
(``local``: one threshold per layer -- per attention for heads --; ``global``: one threshold over every
selected layer) and, for weights, ``granularity`` (``elementwise`` | ``row`` (= ``channel``: output
features / conv channels) | ``head`` (attention heads: q/k/v rows together) | ``ffn`` (feed-forward units: a
Linear whose rows feed an activation and a Linear back to the same width)). Activation pruning (off by
default) masks each selected layer's input at run time: ``l1`` keeps the largest |x| (``local``: per row,
``global``: per tensor) or ``random``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..select import parse_selector_fields

__all__ = ["PruneSection", "PruneArgs", "METHODS", "SCOPES", "GRANULARITIES"]

METHODS: tuple[str, ...] = ("random", "l1", "l2", "taylor", "movement")
ACT_METHODS: tuple[str, ...] = ("random", "l1")
SCOPES: tuple[str, ...] = ("local", "global")
GRANULARITIES: tuple[str, ...] = ("elementwise", "row", "channel", "head", "ffn")
_ALIASES = {"l1-norm": "l1", "l2-norm": "l2", "l1_norm": "l1", "l2_norm": "l2"}
SECTION_KEYS: tuple[str, ...] = ("sparsity", "method", "scope", "granularity")


@dataclass(frozen=True)
class PruneSection:
    """One validated section of the config."""

    sparsity: float = 0.0
    method: str = "l1"
    scope: str = "local"
    granularity: str = "elementwise"

    @classmethod
    def parse(cls, what: str, spec: Any, activation: bool = False) -> PruneSection:
        if not isinstance(spec, Mapping):
            raise ValueError(f"'{what}' must be a dict with keys {list(SECTION_KEYS)}, got {type(spec).__name__}")
        allowed = SECTION_KEYS[:3] if activation else SECTION_KEYS
        unknown = sorted(set(spec) - set(allowed))
        if unknown:
            raise ValueError(f"'{what}': unknown key(s) {unknown}; allowed keys: {list(allowed)}")
        sparsity = spec.get("sparsity", 0.0)
        if isinstance(sparsity, bool) or not isinstance(sparsity, int | float) or not 0.0 <= sparsity < 1.0:
            raise ValueError(f"'{what}.sparsity' must be a fraction in [0, 1) (1 would remove everything), "
                             f"got {sparsity!r}")
        method = _ALIASES.get(str(spec.get("method", "l1")), spec.get("method", "l1"))
        methods = ACT_METHODS if activation else METHODS
        if method not in methods:
            raise ValueError(f"'{what}.method' must be one of {list(methods)}, got {spec.get('method')!r}")
        scope = spec.get("scope", "local")
        if scope not in SCOPES:
            raise ValueError(f"'{what}.scope' must be one of {list(SCOPES)}, got {scope!r}")
        gran = spec.get("granularity", "elementwise")
        if gran not in GRANULARITIES:
            raise ValueError(f"'{what}.granularity' must be one of {list(GRANULARITIES)}, got {gran!r}")
        return cls(float(sparsity), str(method), str(scope), "row" if gran == "channel" else str(gran))


@dataclass(frozen=True)
class PruneArgs:
    """weight / activation sections (see module docstring); targets / exclude: selectors over Linear and
    Conv layers (default: every one, or for head / ffn every layer that has heads / FFN units);
    data / num_batches / loss_fn: calibration batches for ``taylor`` (loss_fn(output, batch) -> scalar,
    default the output's ``loss``); seed: for ``random``."""

    weight: dict[str, Any] | None = None
    activation: dict[str, Any] | None = None
    targets: Any = None
    exclude: Any = None
    data: Any = None
    num_batches: int = 4
    loss_fn: Any = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.weight is None and self.activation is None:
            raise ValueError("give a 'weight' and/or an 'activation' section, e.g. "
                             "{'weight': {'sparsity': 0.5, 'method': 'l1', 'scope': 'global'}}")
        w = self.weight_section
        if w is not None and w.method == "taylor" and self.data is None:
            raise ValueError("method 'taylor' scores weights by |w * dL/dw|: pass calibration batches as 'data'")
        _ = self.activation_section
        if self.num_batches < 1:
            raise ValueError(f"'num_batches' must be >= 1, got {self.num_batches}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError("'loss_fn' must be callable(output, batch) -> scalar loss")
        parse_selector_fields(self)

    @property
    def weight_section(self) -> PruneSection | None:
        return None if self.weight is None else PruneSection.parse("weight", self.weight)

    @property
    def activation_section(self) -> PruneSection | None:
        return None if self.activation is None else PruneSection.parse("activation", self.activation, True)
