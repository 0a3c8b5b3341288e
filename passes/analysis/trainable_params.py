"""report_trainable_parameters_analysis_pass: per-module trainable / frozen parameter counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ...graph.forge_graph import ForgeGraph
from ..base import forge_pass
from ..contract import PassInfo
from .table import format_table


@dataclass(frozen=True)
class TrainableParamsArgs:
    """show: print the table."""

    show: bool = True


@dataclass(frozen=True)
class TrainableParamsInfo(PassInfo):
    """rows: per owning module {module, type, trainable, frozen}; totals; the rendered table."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    trainable: int = 0
    frozen: int = 0
    total: int = 0
    trainable_percent: float = 0.0
    table: str = ""


@forge_pass("analysis", TrainableParamsArgs, info=TrainableParamsInfo, accepts_module=True)
def report_trainable_parameters_analysis_pass(
    graph: ForgeGraph | nn.Module, args: TrainableParamsArgs
) -> tuple[ForgeGraph | nn.Module, TrainableParamsInfo]:
    """Count parameters per module that owns them (tied parameters counted once, at first owner).

    Accepts a ForgeGraph or, as in MASE's tutorial, a bare module (``mg.model``).
    info = {"rows": [...], "trainable": n, "frozen": n, "total": n, "trainable_percent": p, "table": str}.
    """
    module = graph.model if isinstance(graph, ForgeGraph) else graph
    seen: set[int] = set()
    rows: list[dict[str, Any]] = []
    for path, sub in module.named_modules():
        trainable = frozen = 0
        for p in sub.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                trainable += p.numel()
            else:
                frozen += p.numel()
        if trainable or frozen:
            rows.append({"module": path or "<root>", "type": type(sub).__name__,
                         "trainable": trainable, "frozen": frozen})
    n_train = sum(r["trainable"] for r in rows)
    n_frozen = sum(r["frozen"] for r in rows)
    total = n_train + n_frozen
    percent = 100.0 * n_train / total if total else 0.0
    table = format_table(rows) + f"\ntrainable {n_train:,} / total {total:,} ({percent:.2f}%)"
    if args.show:
        print(table)
    return graph, TrainableParamsInfo(rows=rows, trainable=n_train, frozen=n_frozen, total=total,
                                      trainable_percent=percent, table=table)
