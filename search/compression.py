"""PruningSpace, LoRARankSpace and JointSpace: the compression knobs searched together.

Each produces pipeline steps for the standard order (prune → LoRA → fine-tune → fuse → quantize →
lower); :class:`JointSpace` merges its members' plans in that order, so e.g. bits × sparsity × LoRA
rank is one space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import SearchError
from .space import QAT_WITH_LORA, SPACES, SearchSpace, TrialPlan, check_choices, space_from_spec, unknown_keys

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph

__all__ = ["JointSpace", "LoRARankSpace", "PruningSpace"]

PRUNE_METHODS = ("random", "l1", "l2", "taylor")
PRUNE_GRANULARITIES = ("elementwise", "row", "channel", "head", "ffn")


class PruningSpace(SearchSpace):
    """Sparsity per layer group: ``groups`` maps a group name to a selector (default: every Linear).

    Each group samples its sparsity from ``sparsity`` (0 means "leave it dense") and becomes one
    ``prune_transform_pass`` step with MASE's config shape. ``granularity`` is one for every group or a
    mapping group → granularity (e.g. FFN units for the FFN group, heads for the attention group). With
    ``shrink`` (structured granularities only) the pruned rows, heads or FFN units are then physically
    removed (``shrink_transform_pass``), so the model really gets smaller and faster. With ``finetune``
    every trial is fine-tuned after pruning (all weights, through the task: e.g. distilled from the
    unpruned base with ``train_args={"teacher": base, "distill": {...}}``) before any later step such as
    quantization; without it the pruned model is measured as it is (or a LoRA space in the same joint
    space trains its adapters).
    """

    kind = "pruning"

    def __init__(self, sparsity: Sequence[float], groups: Mapping[str, Any] | None = None, method: str = "l1",
                 granularity: str | Mapping[str, str] = "elementwise", scope: str = "local",
                 shrink: bool = False, finetune: bool = False) -> None:
        self.sparsity = check_choices("pruning sparsity", sparsity)
        bad = [s for s in self.sparsity if not isinstance(s, int | float) or isinstance(s, bool) or not 0 <= s < 1]
        if bad:
            raise SearchError(f"pruning sparsity choices must be in [0, 1), got {bad}")
        if method not in PRUNE_METHODS:
            raise SearchError(f"pruning method must be one of {list(PRUNE_METHODS)}, got {method!r}")
        if scope not in ("local", "global"):
            raise SearchError(f"pruning scope must be 'local' or 'global', got {scope!r}")
        self.groups = dict(groups) if groups else {"linear": {"type": ["linear"]}}
        if isinstance(granularity, Mapping):
            unknown = sorted(set(granularity) - set(self.groups))
            missing = sorted(set(self.groups) - set(granularity))
            if unknown or missing:
                raise SearchError(f"pruning granularity per group: unknown group(s) {unknown}, missing {missing}; "
                                  f"groups: {sorted(self.groups)}")
            per_group = {g: granularity[g] for g in self.groups}
        else:
            per_group = dict.fromkeys(self.groups, granularity)
        bad_gran = sorted({str(g) for g in per_group.values() if g not in PRUNE_GRANULARITIES})
        if bad_gran:
            raise SearchError(f"pruning granularity must be one of {list(PRUNE_GRANULARITIES)}, got {bad_gran}")
        if shrink and "elementwise" in per_group.values():
            raise SearchError("pruning shrink needs a structured granularity (row, channel, head, ffn) in every group")
        self.granularity: str | dict[str, str] = dict(granularity) if isinstance(granularity, Mapping) else granularity
        self.per_group = per_group
        self.method, self.scope, self.shrink, self.finetune = method, scope, bool(shrink), bool(finetune)

    def bind(self, graph: ForgeGraph | None) -> PruningSpace:
        from ..passes.base import PASSES

        if "prune_transform_pass" not in PASSES:
            raise SearchError("pruning space: prune_transform_pass is not available in this build")
        return self

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        steps = []
        for group, selector in self.groups.items():
            s = trial.suggest_categorical(f"sparsity:{group}", list(self.sparsity))
            if s > 0:
                steps.append(("prune_transform_pass", {
                    "weight": {"sparsity": float(s), "method": self.method, "scope": self.scope,
                               "granularity": self.per_group[group]},
                    "targets": selector}))
        if steps and self.shrink:
            steps.append(("shrink_transform_pass", {}))
        return TrialPlan(tuple(steps), train=self.finetune)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "sparsity": list(self.sparsity), "groups": self.groups, "method": self.method,
                "granularity": self.granularity, "scope": self.scope, "shrink": self.shrink, "finetune": self.finetune}


class LoRARankSpace(SearchSpace):
    """LoRA rank (and optionally alpha) choices: insert adapters, fine-tune, fuse them back."""

    kind = "lora"

    def __init__(self, rank: Sequence[int], alpha: Sequence[float] | None = None, targets: Any = None,
                 trainable: Any = None) -> None:
        self.rank = check_choices("lora rank", rank)
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in self.rank):
            raise SearchError(f"lora rank choices must be positive ints, got {list(self.rank)}")
        self.alpha = None if alpha is None else check_choices("lora alpha", alpha)
        if self.alpha is not None and any(isinstance(a, bool) or not isinstance(a, int | float) or not a > 0
                                          for a in self.alpha):
            raise SearchError(f"lora alpha choices must be positive numbers, got {list(self.alpha)}")
        self.targets, self.trainable = targets, trainable

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        rank = trial.suggest_categorical("lora:rank", list(self.rank))
        args: dict[str, Any] = {"rank": rank, "alpha": float(rank)}
        if self.alpha is not None:
            args["alpha"] = float(trial.suggest_categorical("lora:alpha", list(self.alpha)))
        if self.targets is not None:
            args["targets"] = self.targets
        if self.trainable is not None:
            args["trainable"] = self.trainable
        return TrialPlan((("insert_lora_adapter_transform_pass", args), ("fuse_lora_weights_transform_pass", {})),
                         train=True)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": list(self.rank), "alpha": None if self.alpha is None else list(self.alpha),
                "targets": self.targets, "trainable": self.trainable}


class JointSpace(SearchSpace):
    """Several spaces sampled together; their steps are merged in the standard compression order."""

    kind = "joint"

    def __init__(self, *spaces: SearchSpace) -> None:
        if not spaces:
            raise SearchError("joint space: give at least one space")
        kinds = [s.kind for s in spaces]
        if len(set(kinds)) != len(kinds):
            raise SearchError(f"joint space: each kind at most once, got {kinds}")
        if "lora" in kinds and any(getattr(s, "qat", False) for s in spaces):  # refused here, before any trial
            raise SearchError(f"joint space (precision qat=True with a LoRA space): {QAT_WITH_LORA}")
        self.spaces = tuple(spaces)

    def bind(self, graph: ForgeGraph | None) -> JointSpace:
        return JointSpace(*(s.bind(graph) for s in self.spaces))

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        plan = TrialPlan()
        for space in self.spaces:
            plan = plan.merged(space.suggest(trial))
        return plan

    @property
    def needs_graph(self) -> bool:
        return all(s.needs_graph for s in self.spaces)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "spaces": [s.to_spec() for s in self.spaces]}


def _pruning(spec: Mapping[str, Any]) -> PruningSpace:
    unknown_keys("pruning", spec, ("sparsity", "groups", "method", "granularity", "scope", "shrink", "finetune"))
    return PruningSpace(**dict(spec))


def _lora(spec: Mapping[str, Any]) -> LoRARankSpace:
    unknown_keys("lora", spec, ("rank", "alpha", "targets", "trainable"))
    return LoRARankSpace(**dict(spec))


def _joint(spec: Mapping[str, Any]) -> JointSpace:
    unknown_keys("joint", spec, ("spaces",))
    spaces = spec.get("spaces")
    if not isinstance(spaces, list):
        raise SearchError("joint space needs 'spaces': a list of space specs")
    return JointSpace(*(space_from_spec(s) for s in spaces))


SPACES.update({"pruning": _pruning, "lora": _lora, "joint": _joint})
