"""A pipeline's report: per step the pass, its args (JSON), wall time, info and contract result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..passes.analysis.table import format_table
from ..passes.contract import jsonable
from .verify import ContractResult

__all__ = ["PipelineReport", "StepReport"]


def _info_json(info: Any) -> Any:
    to_json = getattr(info, "to_json", None)
    return to_json() if callable(to_json) else jsonable(info)


def _contract_cell(step: StepReport) -> str:
    covers = step.contract.covers
    if covers and covers != (step.index,):
        return f"step(s) {'+'.join(map(str, covers))}: {step.contract.summary()}"
    return step.contract.summary()


@dataclass(frozen=True)
class StepReport:
    """One step's record: ``seconds`` is the pass alone; the contract check's cost is in ``contract``."""

    index: int
    name: str
    kind: str
    args: dict[str, Any]
    seconds: float
    info: Any
    contract: ContractResult

    def to_json(self) -> dict[str, Any]:
        return {"step": self.index, "pass": self.name, "kind": self.kind, "args": self.args,
                "seconds": self.seconds, "info": _info_json(self.info), "contract": self.contract.to_json()}


@dataclass(frozen=True)
class PipelineReport:
    """Every step's report plus totals; ``str(report)`` is a table, :meth:`to_json` the data."""

    name: str
    steps: tuple[StepReport, ...]
    seconds: float
    check_forwards: int
    check_seconds: float

    def __getitem__(self, index: int) -> StepReport:
        return self.steps[index]

    def __len__(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.name, "seconds": self.seconds, "check_forwards": self.check_forwards,
                "check_seconds": self.check_seconds, "steps": [s.to_json() for s in self.steps]}

    def table(self, width: int = 60) -> str:
        """One row per step: pass, args, time, info and contract (long cells cut to ``width`` characters)."""

        def cut(value: Any) -> str:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            return text if len(text) <= width else text[: width - 3] + "..."

        rows = [{"#": s.index, "pass": s.name, "args": cut(s.args), "time": f"{s.seconds:.3f}s",
                 "info": cut(_info_json(s.info)), "contract": cut(_contract_cell(s)),
                 "check": f"{s.contract.forwards} fwd {s.contract.seconds:.3f}s"} for s in self.steps]
        total = (f"total {self.seconds:.3f}s; contract checks: {self.check_forwards} forward(s), "
                 f"{self.check_seconds:.3f}s")
        return f"pipeline {self.name}\n{format_table(rows)}\n{total}"

    def __str__(self) -> str:
        return self.table()
