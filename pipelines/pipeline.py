"""Pipeline: an ordered list of passes with their args, validated before anything runs.

``Pipeline([...])(mg)`` returns ``(graph, report)``. Building a pipeline resolves every pass name and
validates every step's args; calling it checks the whole order against the passes' requires / forbids /
ensures / invalidates declarations (passes/contract.plan_properties) before step 1, runs on
``mg.copy()`` unless ``inplace=True`` (one copy for the whole run: its steps then change that graph in place,
``pass.apply_inplace``), checks each transform's numerical contract after it runs
(``verify=True``) and records itself in the graph's history so :meth:`Pipeline.from_history` can
rebuild it from a reloaded checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..graph.forge_graph import ForgeGraph, PassRecord
from ..passes.base import PASSES
from ..passes.contract import ContractError, current_properties, jsonable, plan_properties
from .report import PipelineReport, StepReport
from .steps import ACTIONS, PipelineError, Step, make_step
from .toml import confine_output_paths, load_toml
from .verify import ContractChecker, ContractResult

__all__ = ["ContractViolation", "Pipeline", "PIPELINE_RECORD"]

PIPELINE_RECORD = "pipeline"
StepLike = Any  # "name" | pass_fn | (pass, args) | (pass, args, thresholds) | {"pass", "args", "contract"} | Step
_DOC_KEYS = ("name", "verify", "num_batches", "steps")
_STEP_KEYS = ("pass", "args", "contract")


class ContractViolation(PipelineError, ContractError):
    """A transform broke its numerical contract; ``report`` holds the steps run so far (this one last)."""

    def __init__(self, message: str, report: PipelineReport) -> None:
        super().__init__(message)
        self.report = report


def _step(index: int, item: StepLike) -> Step:
    if isinstance(item, Step):
        return make_step(index, item.fn, item.args, item.thresholds)
    if isinstance(item, str) or callable(item):
        return make_step(index, item)
    if isinstance(item, Mapping):
        unknown = sorted(str(k)[:50] for k in item if k not in _STEP_KEYS)
        if unknown or "pass" not in item:
            why = f"unknown key(s) {unknown}" if unknown else "no 'pass' key"
            raise PipelineError(f"step {index}: {why}; allowed keys: {list(_STEP_KEYS)}")
        return make_step(index, item["pass"], item.get("args"), item.get("contract"))
    if isinstance(item, tuple | list) and 1 <= len(item) <= 3:
        return make_step(index, *item)
    raise PipelineError(f"step {index}: expected a pass name, a pass, (pass, args[, contract]) or "
                        f"{{'pass', 'args', 'contract'}}, got {type(item).__name__}")


class Pipeline:
    """Ordered passes + args. ``verify``: check each transform's contract; ``data`` / ``num_batches``:
    the batches the checks run on (default: the graph's example inputs)."""

    def __init__(self, steps: Sequence[StepLike], name: str = "pipeline", verify: bool = True, data: Any = None,
                 num_batches: int | None = 1) -> None:
        if isinstance(steps, str | Mapping) or not isinstance(steps, Sequence):
            raise PipelineError(f"steps must be a list, got {type(steps).__name__}")
        if not isinstance(name, str) or not isinstance(verify, bool):
            raise PipelineError("name must be a string and verify a bool")
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                        or num_batches < 1):
            raise PipelineError(f"num_batches must be a positive int or None, got {num_batches!r}")
        self.steps: tuple[Step, ...] = tuple(_step(i, s) for i, s in enumerate(steps, 1))
        self.name, self.verify, self.data, self.num_batches = name, verify, data, num_batches

    # -- building ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], **overrides: Any) -> Pipeline:
        """``{"name": ..., "verify": ..., "steps": [{"pass": ..., "args": {...}, "contract": {...}}]}``."""
        if not isinstance(doc, Mapping):
            raise PipelineError(f"a pipeline document must be a table/dict, got {type(doc).__name__}")
        unknown = sorted(str(k)[:50] for k in doc if k not in _DOC_KEYS)
        if unknown:
            raise PipelineError(f"unknown pipeline key(s) {unknown}; allowed keys: {list(_DOC_KEYS)}")
        if "steps" not in doc or not isinstance(doc["steps"], list):
            raise PipelineError("a pipeline document needs 'steps', a list of {'pass', 'args', 'contract'} tables")
        for i, s in enumerate(doc["steps"], 1):
            if not isinstance(s, Mapping):
                raise PipelineError(f"step {i}: expected a table with keys {list(_STEP_KEYS)}, got {type(s).__name__}")
        kwargs = {k: doc[k] for k in ("name", "verify", "num_batches") if k in doc}
        return cls(list(doc["steps"]), **{**kwargs, **overrides})

    @classmethod
    def from_toml(cls, path: str | Path, output_root: str | Path | None = None, allow_outside_root: bool = False,
                  **overrides: Any) -> Pipeline:
        """Read a pipeline file (see pipelines/toml.py); errors name the file (and the line of a syntax error).
        Paths it names for writing (export) resolve under ``output_root`` (default: the current directory);
        ``..`` or absolute ones are refused unless ``allow_outside_root``."""
        doc = load_toml(path)
        try:
            return cls.from_dict(confine_output_paths(doc, output_root, allow_outside_root), **overrides)
        except PipelineError as exc:
            raise PipelineError(f"{path}: {exc}") from None

    @classmethod
    def preset(cls, name: str, args: Mapping[str, Mapping[str, Any]] | None = None, **overrides: Any) -> Pipeline:
        """A named pipeline (pipelines/presets.py: "int8-fast", "int8-dynamic", "lora-finetune"); ``args``
        merges per-pass args by pass name, e.g. ``{"finetune": {"tokenized_dataset": ds, "tokenizer": tok}}``."""
        from .presets import preset_pipeline

        return preset_pipeline(name, args, **overrides)

    @classmethod
    def from_history(cls, graph: ForgeGraph, base: ForgeGraph | None = None, **overrides: Any) -> Pipeline:
        """The pipeline that produced ``graph`` (e.g. a reloaded checkpoint), from its pass history.

        Pipeline records contribute their steps; passes run by hand contribute their recorded args.
        ``base``: the graph it will be replayed on, whose own history (a prefix) is skipped. Export
        steps are dropped; a fine-tune or a step whose args were not plain JSON cannot be replayed.
        """
        history = list(graph.history)
        if base is not None:
            prefix = [r.to_json() for r in base.history]
            if [r.to_json() for r in history[: len(prefix)]] != prefix:
                raise PipelineError("the base graph's history is not a prefix of the graph's history")
            history = history[len(prefix):]
        steps: list[dict[str, Any]] = []
        i = 0
        while i < len(history):
            rec = history[i]
            if rec.kind == PIPELINE_RECORD:
                for s in rec.args.get("steps", []):
                    if not s.get("replayable", False):
                        raise PipelineError(f"history record {i + 1} (pipeline {rec.args.get('name')!r}): step "
                                            f"{s.get('pass')!r} used args that are not plain JSON (data, tensors, "
                                            "a fine-tune); it cannot be replayed")
                    steps.append({k: s[k] for k in _STEP_KEYS if k in s})
                i += 1 + int(rec.args.get("records", 0))
                continue
            if _summarised(rec.args):
                raise PipelineError(f"history record {i + 1} ({rec.name}) holds summarised args {rec.args}; "
                                    "it cannot be replayed")
            steps.append({"pass": rec.name, "args": dict(rec.args)})
            i += 1
        steps = [s for s in steps if s["pass"] != "export"]
        try:
            return cls(steps, **{"name": "replay", **overrides})
        except PipelineError as exc:
            raise PipelineError(f"cannot rebuild the pipeline from the graph's history: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verify": self.verify, "num_batches": self.num_batches,
                "steps": [s.to_json() for s in self.steps]}

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, steps={[s.name for s in self.steps]}, verify={self.verify})"

    def __len__(self) -> int:
        return len(self.steps)

    # -- running ----------------------------------------------------------------------------------------
    def check_order(self, graph: ForgeGraph) -> None:
        """Refuse an order whose requirements cannot hold, starting from the graph's current properties."""
        try:
            plan_properties([s.spec for s in self.steps], current_properties(graph), {**PASSES, **ACTIONS})
        except ContractError as exc:
            raise PipelineError(f"pipeline {self.name!r}: impossible order: {exc}") from None

    def __call__(self, graph: ForgeGraph, inplace: bool = False, verify: bool | None = None,
                 data: Any = None) -> tuple[ForgeGraph, PipelineReport]:
        """Run every step on ``graph.copy()`` (or ``graph`` itself when ``inplace``); returns (graph, report)."""
        if not isinstance(graph, ForgeGraph):
            raise TypeError(f"pipeline {self.name!r}: expected a ForgeGraph, got {type(graph).__name__}")
        verify = self.verify if verify is None else verify
        self.check_order(graph)
        mg = graph if inplace else graph.copy()
        checked = verify and any(s.contract is not None for s in self.steps)
        try:
            checker = ContractChecker(mg, self.data if data is None else data, self.num_batches) if checked else None
        except (TypeError, ValueError) as exc:
            raise PipelineError(f"pipeline {self.name!r}: contract checks need batches: {exc} "
                                "(give data=[batch, ...] or verify=False)") from None
        started = time.perf_counter()
        reports: list[StepReport] = []
        done: list[Step] = []
        pos = len(mg.history)
        mg.history.append(self._record(done, 0, verify))
        for step in self.steps:
            mg, report = self._run_step(mg, step, verify, checker)
            reports.append(report)
            if step.name != "export":
                done.append(step)
            mg.history[pos] = self._record(done, len(mg.history) - pos - 1, verify)
            if report.contract.ok:
                continue
            raise ContractViolation(
                f"pipeline {self.name!r}: contract broken, checked after step {step.index} ({step.name}): "
                f"{report.contract.violation}", self._report(reports, started, checker))
        if checker is not None:
            pending, why = checker.unfinished()
            for i in pending:
                reports[i - 1] = dataclasses.replace(reports[i - 1], contract=ContractResult(
                    kind="unchecked", ok=True, violation=f"the graph never became runnable ({why})"))
        return mg, self._report(reports, started, checker)

    def _run_step(self, mg: ForgeGraph, step: Step, verify: bool,
                  checker: ContractChecker | None) -> tuple[ForgeGraph, StepReport]:
        contract = step.contract if verify and step.spec.kind == "transform" else None
        if checker is not None:
            checker.before_step(mg, contract)
        t0 = time.perf_counter()
        try:
            out, info = step.run_inplace(mg)
        except Exception as exc:
            raise PipelineError(f"pipeline {self.name!r} step {step.index} ({step.name}) failed: {exc}") from exc
        seconds = time.perf_counter() - t0
        result = checker.after_step(out, step.index, step.name, contract) if checker is not None else None
        if result is None:
            kind = "analysis" if step.spec.kind != "transform" else ("off" if not verify else "none")
            result = ContractResult(kind=kind, ok=True)
        return out, StepReport(step.index, step.name, step.spec.kind, jsonable(dict(step.args)), seconds, info,
                               result)

    def _record(self, done: list[Step], records: int, verify: bool) -> PassRecord:
        """The history entry: the steps run so far (as given), and how many pass records follow it."""
        steps = [{**s.to_json(), "replayable": s.replayable} for s in done]
        return PassRecord(name=PIPELINE_RECORD, kind=PIPELINE_RECORD,
                          args={"name": self.name, "verify": verify, "steps": steps, "records": records})

    def _report(self, reports: list[StepReport], started: float, checker: ContractChecker | None) -> PipelineReport:
        return PipelineReport(self.name, tuple(reports), time.perf_counter() - started,
                              checker.forwards if checker else 0, sum(r.contract.seconds for r in reports))


def _summarised(value: Any) -> bool:
    """Whether recorded args hold a summary (``"<tensor ...>"``, ``"<Dataset>"``) instead of the value."""
    if isinstance(value, str):
        return value.startswith("<") and value.endswith(">")
    if isinstance(value, Mapping):
        return any(_summarised(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_summarised(v) for v in value)
    return False

