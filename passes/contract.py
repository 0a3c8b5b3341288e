"""What passes promise: graph properties they require / forbid / ensure / invalidate, typed infos,
and the numerical contract of a transform.

A *property* is a named predicate over a ForgeGraph, always derived from the graph itself (never a
stored flag that could go stale): ``"metadata"`` holds when every node carries fxforge metadata,
``"quantized"`` when a quantized layer is in the graph, and so on. The pass decorator checks a pass's
``requires`` / ``forbids`` before it runs and its ``ensures`` after; pipelines use the same
declarations to check a whole order of passes before the first one runs (:func:`plan_properties`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..graph.json_values import jsonable
from ..graph.metadata import has_meta

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph


class ContractError(RuntimeError):
    """A pass's requirements are not met, or a pass broke what it promised."""


# -- graph properties -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphProperty:
    """A named, derived predicate over a graph, with a one-line meaning for error messages."""

    name: str
    check: Callable[[ForgeGraph], bool]
    meaning: str


PROPERTIES: dict[str, GraphProperty] = {}


def register_property(name: str, check: Callable[[ForgeGraph], bool], meaning: str) -> GraphProperty:
    """Register a property; re-registering the same name with another check is an error."""
    old = PROPERTIES.get(name)
    if old is not None and old.check is not check:
        raise ValueError(f"graph property {name!r} is already registered ({old.meaning})")
    prop = GraphProperty(name, check, meaning)
    PROPERTIES[name] = prop
    return prop


def holds(name: str, graph: ForgeGraph) -> bool:
    """Whether property ``name`` holds on ``graph``; KeyError listing the known properties."""
    if name not in PROPERTIES:
        raise KeyError(f"unknown graph property {name!r}; known: {sorted(PROPERTIES)}")
    return bool(PROPERTIES[name].check(graph))


def current_properties(graph: ForgeGraph) -> frozenset[str]:
    """Every registered property that holds on ``graph`` now."""
    return frozenset(name for name, prop in PROPERTIES.items() if prop.check(graph))


def _has_metadata(graph: ForgeGraph) -> bool:
    return all(has_meta(n) for n in graph.model.graph.nodes)


def _has_shapes(graph: ForgeGraph) -> bool:
    nodes = list(graph.model.graph.nodes)
    return _has_metadata(graph) and all(
        n.meta["fxforge"].common.results or n.op == "output" for n in nodes)


def _has_checkpoint_regions(graph: ForgeGraph) -> bool:
    return any(getattr(m, "recomputed_in_backward", False) is True for m in graph.model.modules())


def _has_pipeline_stages(graph: ForgeGraph) -> bool:
    return any(getattr(m, "pipeline_stage", False) is True for m in graph.model.modules())


register_property("pipeline-stages", _has_pipeline_stages,
                  "the graph is a chain of pipeline stages (split_stages_transform_pass), whose layers module "
                  "transforms cannot select")
register_property("metadata", _has_metadata, "every node carries fxforge metadata (init_metadata_analysis_pass)")
register_property("activation-checkpointed", _has_checkpoint_regions,
                  "parts of the graph run inside checkpointed regions (activation_checkpoint_transform_pass), whose "
                  "layers module transforms cannot select")
register_property("shapes", _has_shapes,
                  "every node's metadata records its result shapes (add_common_metadata_analysis_pass)")


# -- declarations -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassSpec:
    """A pass's declared contract, attached to the registered function as ``fn.spec``."""

    name: str
    kind: str
    args_type: type[Any]
    info_type: type[Any]
    requires: tuple[str, ...] = ()
    forbids: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()
    invalidates: tuple[str, ...] = ()
    contract: NumericalContract | None = None


def check_declared(names: Iterable[str], pass_name: str) -> tuple[str, ...]:
    out = tuple(names)
    unknown = [n for n in out if n not in PROPERTIES]
    if unknown:
        raise ValueError(f"{pass_name}: unknown graph propert(ies) {unknown}; known: {sorted(PROPERTIES)} "
                         "(register_property first)")
    return out


def providers(prop: str, passes: Mapping[str, Any]) -> list[str]:
    """Names of registered passes that ensure ``prop`` (for 'run X first' messages)."""
    return sorted(n for n, fn in passes.items() if prop in getattr(getattr(fn, "spec", None), "ensures", ()))


def _before_hint(name: str, prop: str, passes: Mapping[str, Any]) -> str:
    """What to do when ``prop`` already holds: run the pass on the graph from before the pass that made it."""
    makers = providers(prop, passes)
    made = f" ({' or '.join(makers)})" if makers else ""
    return (f"run {name} on the graph from before {prop!r} was made{made}; a transform leaves its input unchanged "
            "and returns a new graph, so keep the base graph and pass it each time (or a base.copy() taken earlier)")


def requirement_errors(spec: PassSpec, present: frozenset[str] | Callable[[str], bool],
                       passes: Mapping[str, Any]) -> list[str]:
    """Why ``spec`` cannot run given the properties present (a set, or a predicate); [] when it can."""
    has = present if callable(present) else present.__contains__
    errors = []
    for prop in spec.requires:
        if not has(prop):
            first = providers(prop, passes)
            hint = f"; run {' or '.join(first)} first" if first else ""
            errors.append(f"requires {prop!r} ({PROPERTIES[prop].meaning}), which does not hold{hint}")
    for prop in spec.forbids:
        if has(prop):
            errors.append(f"cannot run on a graph where {prop!r} holds ({PROPERTIES[prop].meaning}): "
                          f"{_before_hint(spec.name, prop, passes)}")
    return errors


def plan_properties(steps: Iterable[PassSpec], start: frozenset[str],
                    passes: Mapping[str, Any]) -> list[frozenset[str]]:
    """Check an order of passes statically; returns the properties expected before each step.

    Raises ContractError naming the first step (1-based) whose requirements cannot hold.
    """
    present, out = set(start), []
    for i, spec in enumerate(steps, 1):
        errors = requirement_errors(spec, frozenset(present), passes)
        if errors:
            raise ContractError(f"step {i} ({spec.name}) {'; '.join(errors)}")
        out.append(frozenset(present))
        present -= set(spec.invalidates)
        present |= set(spec.ensures)
    return out


# -- typed results ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PassInfo:
    """Base of every pass's typed, frozen result. ``info.field`` is the API; ``info["field"]`` and
    ``to_json()`` keep dict-style readers and reports working.

    ``changed`` (every transform's info): whether the transform changed the graph. A pass may set it; when
    it leaves it None the pass decorator sets it by comparing the graph's code, modules and tensors before
    and after (passes/base). It stays None on analysis infos, and ``to_json()`` leaves it out then.
    """

    changed: bool | None = dataclasses.field(default=None, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        out = jsonable(self)
        if self.changed is None:
            out.pop("changed")
        return out

    def __getitem__(self, key: str) -> Any:
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(f"{type(self).__name__} has no field {key!r}; fields: {self.keys()}")
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def _repr_html_(self) -> str | None:
        """Jupyter: a field / value table (the view report/notebook.py registers; None: plain repr)."""
        from ..graph.html_view import html_view

        return html_view(self)


@dataclass(frozen=True)
class EmptyInfo(PassInfo):
    """The info of a pass that reports nothing beyond its history record."""


# -- numerical contracts ----------------------------------------------------------------------------
ContractKind = Literal["exact", "bounded"]


@dataclass(frozen=True)
class NumericalContract:
    """What a transform promises about outputs, checked by pipelines (and tests) after it runs.

    ``exact``: outputs before and after agree within ``atol`` + ``rtol``·|before| in ``mode``.
    ``bounded``: the error is measured and reported (max abs diff, SQNR in dB); it fails only when
    the user (or the pass) sets a threshold: ``max_abs`` and/or ``min_sqnr_db``.
    """

    kind: ContractKind
    atol: float = 1e-5
    rtol: float = 1e-5
    mode: Literal["eval", "train"] = "eval"
    max_abs: float | None = None
    min_sqnr_db: float | None = None
    note: str = ""

    def with_thresholds(self, **overrides: Any) -> NumericalContract:
        """A copy with user thresholds (e.g. ``atol=1e-4``, ``min_sqnr_db=20``); unknown keys are an error."""
        allowed = {"atol", "rtol", "max_abs", "min_sqnr_db"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"unknown contract threshold(s) {unknown}; allowed: {sorted(allowed)}")
        return dataclasses.replace(self, **overrides)
