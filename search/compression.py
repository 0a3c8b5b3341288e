"""PruningSpace, LoRARankSpace and JointSpace: the compression knobs searched together.

Each produces pipeline steps for the standard order (prune → LoRA → fine-tune → fuse → quantize →
lower); :class:`JointSpace` merges its members' plans in that order, so e.g. bits × sparsity × LoRA
rank is one space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import SearchError
from .priors import SPARSITY_BUDGETS, allocations, allowed_choices, check_prior_args, sensitivity_bound
from .space import QAT_WITH_LORA, SPACES, SearchSpace, TrialPlan, check_choices, space_from_spec, unknown_keys

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph
    from ..passes.analysis.sensitivity_types import SensitivityInfo

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

    With ``prior="sensitivity"`` (every group pruning ``head`` or ``ffn`` units, at most one group each) the
    study measures each attention's / FFN's loss increase per sparsity once; each group keeps the sparsities
    within ``loss_bound`` (default half the baseline loss; the smallest always) and allocations minimising
    the loss at several overall sparsities are enqueued first (search/priors.py).
    """

    kind = "pruning"

    def __init__(self, sparsity: Sequence[float], groups: Mapping[str, Any] | None = None, method: str = "l1",
                 granularity: str | Mapping[str, str] = "elementwise", scope: str = "local",
                 shrink: bool = False, finetune: bool = False, prior: str | None = None,
                 loss_bound: float | None = None) -> None:
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
        check_prior_args("pruning", prior, loss_bound)
        kinds = [_KINDS.get(g) for g in per_group.values()]
        if prior is not None and (None in kinds or len(set(kinds)) != len(kinds)):
            raise SearchError("pruning space: prior='sensitivity' measures attention heads and FFN units: give each "
                              f"group granularity 'head' or 'ffn', at most one group each (got {per_group})")
        self.prior, self.loss_bound = prior, loss_bound
        self.sparsity_by_group: dict[str, tuple[float, ...]] = {}  # the prior's restriction (with_sensitivity)
        self.group_loss: dict[str, dict[float, float]] = {}
        self.group_params: dict[str, int] = {}

    def bind(self, graph: ForgeGraph | None) -> PruningSpace:
        from ..passes.base import PASSES

        if "prune_transform_pass" not in PASSES:
            raise SearchError("pruning space: prune_transform_pass is not available in this build")
        return self

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        steps = []
        for group, selector in self.groups.items():
            choices = self.sparsity_by_group.get(group, self.sparsity)
            s = trial.suggest_categorical(f"sparsity:{group}", list(choices))
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
                "granularity": self.granularity, "scope": self.scope, "shrink": self.shrink, "finetune": self.finetune,
                **({"prior": self.prior} if self.prior is not None else {}),
                **({"loss_bound": self.loss_bound} if self.loss_bound is not None else {})}

    def sensitivity_request(self) -> dict[str, Any]:
        """What sensitivity_analysis_pass must measure for this space: its non-zero sparsities."""
        return {"prune_ratios": tuple(sorted({float(s) for s in self.sparsity if s > 0}))}

    def with_sensitivity(self, info: SensitivityInfo, graph: ForgeGraph | None) -> PruningSpace:
        """A copy whose groups keep only the sparsities within the loss bound (the smallest always); a group's
        loss at a sparsity sums its kind's measured groups (every attention for ``head``, every FFN for ``ffn``)."""
        shaped = PruningSpace.__new__(PruningSpace)
        shaped.__dict__.update(self.__dict__)
        shaped.sparsity_by_group, shaped.group_loss, shaped.group_params = {}, {}, {}
        bound = sensitivity_bound(info, self.loss_bound)
        for group, selector in self.groups.items():
            measured = [g for g in info.groups if g.kind == _KINDS[self.per_group[group]]]
            if not measured:
                raise SearchError(f"pruning space: the sensitivity measured has no {_KINDS[self.per_group[group]]} "
                                  f"group for {group!r}: it was measured on another model; start a new study")
            loss = {s: sum(_prune_loss(g.prune, s, g.name) for g in measured) for s in self.sparsity}
            shaped.group_loss[group] = loss
            shaped.sparsity_by_group[group] = allowed_choices(loss, min(self.sparsity), bound)
            shaped.group_params[group] = _weight_count(graph, [p for g in measured for p in g.layers], selector)
        return shaped

    def prior_allocations(self) -> list[dict[str, Any]]:
        """``sparsity:<group>`` for each allocation minimising the summed loss increase at
        :data:`SPARSITY_BUDGETS` overall sparsity (weighted by each group's weight count)."""
        groups = list(self.groups)
        options = [[(s, (1 - s) * self.group_params[g], self.group_loss[g][s]) for s in self.sparsity_by_group[g]]
                   for g in groups]
        total = sum(self.group_params[g] for g in groups)
        return [{f"sparsity:{g}": s for g, s in zip(groups, chosen)}
                for chosen in allocations(options, [(1 - b) * total for b in SPARSITY_BUDGETS])]


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


_KINDS = {"head": "heads", "ffn": "ffn"}  # pruning granularity -> the sensitivity group kind it prunes


def _weight_count(graph: ForgeGraph | None, paths: Sequence[str], selector: Any) -> int:
    """Weights a group prunes from: those of the measured groups' layers, else of the layers its selector
    selects (1 without a graph: groups then weigh the same)."""
    from ..passes.select import select_nodes

    if graph is None:
        return 1
    modules = [graph.model.get_submodule(p) for p in paths if _has_module(graph, p)] if paths else \
        [m for _, _, m, _ in select_nodes(graph.model, selector, modules_only=True)]
    weights = (getattr(m, "weight", None) for m in modules)
    return sum(w.numel() for w in weights if isinstance(w, torch.Tensor)) or 1


def _has_module(graph: ForgeGraph, path: str) -> bool:
    try:
        graph.model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _prune_loss(measured: Sequence[tuple[float, float]], sparsity: float, name: str) -> float:
    """The measured loss increase at ``sparsity`` (0 when dense); SearchError when it was not measured."""
    if sparsity == 0:
        return 0.0
    for ratio, loss in measured:
        if abs(ratio - sparsity) < 1e-9:
            return loss
    raise SearchError(f"pruning space: sparsity {sparsity} of {name!r} was not measured "
                      f"(measured {[r for r, _ in measured]}); start a new study")


def _pruning(spec: Mapping[str, Any]) -> PruningSpace:
    unknown_keys("pruning", spec, ("sparsity", "groups", "method", "granularity", "scope", "shrink", "finetune",
                                   "prior", "loss_bound"))
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
