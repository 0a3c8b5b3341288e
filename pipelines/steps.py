"""Pipeline steps: a registered pass (or a pipeline action) plus its validated args and contract thresholds.

Everything a step needs is resolved when the step is built, so a typo in step 3 is refused before
step 1 runs: the pass name must be registered (else close names are suggested), its args must build
the pass's args dataclass (passes/base.build_args) and contract
thresholds must be known keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..passes.base import PASS_ALIASES, PASSES, PassArgsError, PassFn, build_args
from ..passes.contract import EmptyInfo, NumericalContract, PassInfo, PassSpec
from ..passes.mase_names import MaseNameRefused, mase_pass_name

__all__ = ["ACTIONS", "PipelineError", "Step", "make_step", "pass_spec", "resolve_pass"]


class PipelineError(RuntimeError):
    """A pipeline cannot be built or a step failed; the message names the step and the pass."""


# -- pipeline actions: steps that are not graph passes (export, fine-tune) ------------------------------------
@dataclass(frozen=True)
class ExportArgs:
    """path: directory the checkpoint is written to (graph/checkpoint.save_checkpoint)."""

    path: str
    OUTPUT_PATHS: ClassVar[tuple[str, ...]] = ("path",)  # written to: kept under the output root when a file names it


@dataclass(frozen=True)
class ExportInfo(PassInfo):
    path: str


@dataclass(frozen=True)
class FinetuneArgs:
    """tokenized_dataset / tokenizer: as data.get_trainer takes them (data, passed by reference);
    trainer: get_trainer keyword arguments (num_train_epochs, learning_rate, max_steps, ...)."""

    tokenized_dataset: Any
    tokenizer: Any = None
    trainer: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FinetuneInfo(PassInfo):
    train_loss: float | None
    eval: dict


def _export(graph: Any, args: ExportArgs) -> tuple[Any, ExportInfo]:
    return graph, ExportInfo(path=str(graph.export(Path(args.path))))


def _finetune(graph: Any, args: FinetuneArgs) -> tuple[Any, FinetuneInfo]:
    from ..data import get_trainer

    trainer = get_trainer(graph, args.tokenized_dataset, args.tokenizer, **args.trainer)
    out = trainer.train()
    metrics = trainer.evaluate() if "test" in args.tokenized_dataset else {}
    graph.model.eval()
    loss = getattr(out, "training_loss", None)
    return graph, FinetuneInfo(train_loss=float(loss) if loss is not None else None,
                               eval={k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})


def _action(fn: Callable[[Any, Any], tuple[Any, Any]], name: str, kind: str, args_type: type, info: type,
            contract: NumericalContract | None) -> PassFn:
    """``fn`` declared as a pipeline step (a PassFn, like a registered pass, but not in PASSES)."""
    action = typing.cast(PassFn, fn)  # a plain function until its declarations are set just below
    action.spec = PassSpec(name=name, kind=kind, args_type=args_type, info_type=info, contract=contract)
    action.pass_name = name
    action.pass_kind = kind
    action.args_type = args_type
    action.apply_inplace = action  # an action always works on the pipeline's own graph
    return action


# "export" writes files and changes nothing; "finetune" trains weights (its error is measured, never bounded).
ACTIONS: dict[str, PassFn] = {
    "export": _action(_export, "export", "analysis", ExportArgs, ExportInfo, None),
    "finetune": _action(_finetune, "finetune", "transform", FinetuneArgs, FinetuneInfo,
                        NumericalContract("bounded", note="fine-tuning changes outputs on purpose")),
}


# -- resolving passes ---------------------------------------------------------------------------------------
def resolve_pass(name_or_fn: str | Callable[..., Any]) -> tuple[str, PassFn]:
    """(name, callable) of a registered pass or action; PipelineError listing close names otherwise."""
    if callable(name_or_fn):
        name = getattr(name_or_fn, "pass_name", None)
        registered = [p for p in (PASSES.get(name), ACTIONS.get(name)) if p is name_or_fn] \
            if isinstance(name, str) else []
        if not registered:
            raise PipelineError(f"{getattr(name_or_fn, '__name__', name_or_fn)!r} is not a registered pass "
                                "(decorate it with passes.forge_pass)")
        return registered[0].pass_name, registered[0]
    if not isinstance(name_or_fn, str):
        raise PipelineError(f"a step's pass must be a pass name or a pass function, got {type(name_or_fn).__name__}")
    if name_or_fn in ACTIONS:
        return name_or_fn, ACTIONS[name_or_fn]
    name_or_fn = PASS_ALIASES.get(name_or_fn, name_or_fn)  # a pass's former public name
    if name_or_fn not in PASSES:
        try:
            name_or_fn = mase_pass_name(name_or_fn) or name_or_fn  # MASE's short or full name
        except MaseNameRefused as exc:
            raise PipelineError(str(exc)) from None
    if name_or_fn not in PASSES:
        known = sorted(PASSES) + sorted(ACTIONS)
        close = difflib.get_close_matches(name_or_fn, known, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise PipelineError(f"unknown pass {name_or_fn[:100]!r}; {hint}registered passes: {known}")
    return name_or_fn, PASSES[name_or_fn]


def pass_spec(name: str, fn: Callable[..., Any]) -> PassSpec:
    """The pass's declared spec (a bare one from its kind and args type when it declares none yet)."""
    spec = getattr(fn, "spec", None)
    if isinstance(spec, PassSpec):
        return spec
    return PassSpec(name=name, kind=getattr(fn, "pass_kind", "transform"),
                    args_type=getattr(fn, "args_type", type(None)), info_type=EmptyInfo)


def plain(value: Any) -> bool:
    """Whether ``value`` survives a JSON round trip (so a recorded step can be replayed exactly)."""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class Step:
    """One resolved step: the pass, the user's args (kept as given), the built args, the contract to check."""

    index: int
    name: str
    fn: PassFn = field(repr=False, compare=False)
    spec: PassSpec = field(repr=False, compare=False)
    args: Mapping[str, Any] = field(default_factory=dict)
    built: Any = field(default=None, repr=False, compare=False)
    thresholds: Mapping[str, float] = field(default_factory=dict)
    contract: NumericalContract | None = None

    def to_json(self) -> dict[str, Any]:
        from ..passes.contract import jsonable

        out: dict[str, Any] = {"pass": self.name, "args": jsonable(dict(self.args))}
        if self.thresholds:
            out["contract"] = dict(self.thresholds)
        return out

    def run_inplace(self, graph: Any) -> tuple[Any, Any]:
        """Run the step on ``graph`` itself (the pipeline owns it: no copy per step, see passes/base)."""
        return self.fn.apply_inplace(graph, self.built)

    @property
    def replayable(self) -> bool:
        return plain(dict(self.args)) and self.name != "finetune"


def _build(name: str, args_type: type, args: Mapping[str, Any] | None) -> Any:
    if dataclasses.is_dataclass(args_type) or hasattr(args_type, "from_pass_args"):
        return build_args(name, args_type, args)
    return args  # a pass without a declared args type validates its own args when it runs


def make_step(index: int, pass_: str | Callable[..., Any], args: Mapping[str, Any] | None = None,
              contract: Mapping[str, float] | None = None) -> Step:
    """Resolve and validate one step (1-based ``index`` for messages); PipelineError naming the step."""
    where = f"step {index}"
    try:
        name, fn = resolve_pass(pass_)
    except PipelineError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    if args is not None and not isinstance(args, Mapping):
        raise PipelineError(f"{where} ({name}): args must be a table/dict, got {type(args).__name__}")
    if contract is not None and not isinstance(contract, Mapping):
        raise PipelineError(f"{where} ({name}): contract must be a table of thresholds, got {type(contract).__name__}")
    spec = pass_spec(name, fn)
    try:
        built = _build(name, spec.args_type, args)
    except PassArgsError as exc:
        raise PipelineError(f"{where} ({name}): invalid args: {exc}") from exc
    thresholds = dict(contract or {})
    declared = spec.contract
    try:
        if thresholds and spec.kind != "transform":
            raise ValueError(f"{name} is an analysis pass and has no numerical contract to set thresholds on")
        if declared is None and thresholds:
            declared = NumericalContract("bounded", note="thresholds set by the user; the pass declares none")
        resolved = declared.with_thresholds(**thresholds) if declared is not None else None
    except (TypeError, ValueError) as exc:
        raise PipelineError(f"{where} ({name}): invalid contract thresholds: {exc}") from exc
    bad = [k for k, v in thresholds.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise PipelineError(f"{where} ({name}): contract thresholds {bad} must be numbers")
    return Step(index=index, name=name, fn=fn, spec=spec, args=dict(args or {}), built=built,
                thresholds=thresholds, contract=resolved)
