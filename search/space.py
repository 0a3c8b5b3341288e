"""The search-space interface: a small typed object that turns an Optuna trial into a plan.

A :class:`TrialPlan` is data: pipeline steps to run before and after an optional fine-tune, and (for
NAS) the model-config overrides of a freshly built model. Its :meth:`TrialPlan.key` hashes that data,
so identical plans are evaluated once (the cache is keyed by the pipeline's content, not by trial).
Spaces serialise to JSON specs (:meth:`SearchSpace.to_spec`), so a worker process on another machine
rebuilds the same space from the study, and resuming with a different space is detected.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..passes.contract import jsonable
from .errors import SearchError

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph

__all__ = ["SPACES", "SearchSpace", "Step", "TrialPlan", "check_choices", "space_from_spec", "stage_of"]

Step = tuple[str, Mapping[str, Any]]

# Stage of each pass in the standard compression order (prune → LoRA → [train] → fuse → quantize → lower).
STAGES: dict[str, float] = {
    "prune_transform_pass": 0, "shrink_transform_pass": 0.5, "insert_lora_adapter_transform_pass": 1,
    "fuse_lora_weights_transform_pass": 3, "quantize_transform_pass": 4, "calibrate_analysis_pass": 5,
    "calibrate_transform_pass": 5, "lower_int8_transform_pass": 6,
}
TRAIN_STAGE = 2
# Quantization-aware plans quantize (and calibrate) after pruning/shrinking but before the fine-tune.
QAT_STEPS = ("quantize_transform_pass", "calibrate_analysis_pass", "calibrate_transform_pass")
QAT_STAGE = 1.5
LORA_STEPS = ("insert_lora_adapter_transform_pass", "fuse_lora_weights_transform_pass")
QAT_WITH_LORA = ("quantization-aware training cannot be combined with LoRA: the adapters are fused into the "
                 "weights after training, which would undo the quantization")


def stage_of(name: str, qat: bool = False) -> float:
    """Where a pass runs in a plan (:data:`STAGES`; under qat, quantization moves before training)."""
    return QAT_STAGE if qat and name in QAT_STEPS else STAGES.get(name, 99)


@dataclass(frozen=True)
class TrialPlan:
    """What one trial evaluates: steps (ordered by stage), whether to fine-tune, NAS config overrides.

    With ``qat`` (quantization-aware training) the quantize steps run before the fine-tune, which then
    trains through the quantizers' straight-through gradients; otherwise quantization follows training.
    """

    steps: tuple[Step, ...] = ()
    train: bool = False
    model_config: Mapping[str, Any] | None = None
    identity_layers: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    qat: bool = False

    def __post_init__(self) -> None:
        if self.qat and any(name in LORA_STEPS for name, _ in self.steps):
            raise SearchError(QAT_WITH_LORA)

    def before_training(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if stage_of(s[0], self.qat) < TRAIN_STAGE)

    def after_training(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if stage_of(s[0], self.qat) > TRAIN_STAGE)

    def to_json(self) -> dict[str, Any]:
        doc = {"steps": [[name, jsonable(args)] for name, args in self.steps], "train": self.train,
               "model_config": jsonable(self.model_config), "identity_layers": list(self.identity_layers)}
        if self.qat:  # only when set, so plans (and cache keys) stored before the flag existed stay equal
            doc["qat"] = True
        return doc

    def key(self) -> str:
        """A stable hash of the plan's content (the evaluation cache key)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def merged(self, other: TrialPlan) -> TrialPlan:
        """Both plans' steps in stage order; NAS overrides may come from one side only; qat if either is."""
        if self.model_config is not None and other.model_config is not None:
            raise SearchError("a joint space may hold at most one NAS space")
        qat = self.qat or other.qat
        steps = sorted((*self.steps, *other.steps), key=lambda s: stage_of(s[0], qat))
        return TrialPlan(tuple(steps), self.train or other.train,
                         self.model_config if self.model_config is not None else other.model_config,
                         (*self.identity_layers, *other.identity_layers), {**self.params, **other.params}, qat)


def check_choices(name: str, values: Any) -> tuple[Any, ...]:
    """A non-empty tuple of JSON-able choices; SearchError naming the parameter otherwise."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or len(values) == 0:
        raise SearchError(f"{name}: choices must be a non-empty list, got {values!r}")
    out = tuple(values)
    for v in out:
        if not (v is None or isinstance(v, bool | int | float | str)):
            raise SearchError(f"{name}: choice {v!r} is not a number, string, bool or None")
    return out


class SearchSpace(ABC):
    """Turns a trial into a :class:`TrialPlan`; ``bind`` resolves layer names against the base graph."""

    kind: ClassVar[str] = ""

    def bind(self, graph: ForgeGraph | None) -> SearchSpace:
        """Validate against the base graph (None for NAS) and return the space to sample from."""
        return self

    @abstractmethod
    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        """Sample one plan from ``trial`` (a study's, or a FixedTrial replaying given parameters); raise
        optuna.TrialPruned for an invalid combination (before any training)."""

    @abstractmethod
    def to_spec(self) -> dict[str, Any]:
        """JSON spec from which :func:`space_from_spec` rebuilds an equal space."""

    @property
    def needs_graph(self) -> bool:
        """True when trials start from the base graph (every space but NAS)."""
        return True


SPACES: dict[str, Callable[[Mapping[str, Any]], SearchSpace]] = {}


def space_from_spec(spec: Mapping[str, Any]) -> SearchSpace:
    """Rebuild a space from its JSON/TOML spec (``{"kind": "nas" | "precision" | ...}``)."""
    if not isinstance(spec, Mapping) or "kind" not in spec:
        raise SearchError(f"a space spec needs a 'kind' (one of {sorted(SPACES)}), got {spec!r}")
    kind = spec["kind"]
    if not isinstance(kind, str) or kind not in SPACES:
        raise SearchError(f"unknown space kind {kind!r}; known: {sorted(SPACES)}")
    return SPACES[kind]({k: v for k, v in spec.items() if k != "kind"})


def unknown_keys(kind: str, given: Mapping[str, Any], allowed: Sequence[str]) -> None:
    bad = sorted(set(given) - set(allowed))
    if bad:
        raise SearchError(f"{kind} space: unknown key(s) {bad}; allowed: {sorted(allowed)}")
