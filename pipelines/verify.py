"""Checking a transform's numerical contract after it runs, at most one extra forward per step.

The outputs of the graph after a checked step are kept and become the "before" of the next checked
step, so a pipeline of N checked transforms costs N + 1 forwards per batch. Analysis passes do not
change outputs, so the kept outputs survive them unless the graph's tensors changed (a cheap
fingerprint of parameter/buffer identities and version counters says so). Batches come from the
shared helpers (passes/batching) and errors are measured by passes/metrics.compare_outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..graph.forge_graph import ForgeGraph
from ..passes.batching import iter_batches, run_batch
from ..passes.contract import NumericalContract, jsonable
from ..passes.metrics import OutputDiff, compare_outputs

__all__ = ["ContractChecker", "ContractResult", "OutputCache", "evaluate_contract", "state_fingerprint"]


@dataclass(frozen=True)
class ContractResult:
    """What was checked after one step: the contract, the measured error, whether it held, the cost."""

    kind: str
    ok: bool
    max_abs: float | None = None
    ref_max: float | None = None
    sqnr_db: float | None = None
    limits: dict[str, float] = field(default_factory=dict)
    violation: str = ""
    forwards: int = 0
    seconds: float = 0.0
    covers: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return jsonable(self)

    def summary(self) -> str:
        if self.kind in SKIPPED:
            return SKIPPED[self.kind]
        if self.kind in ("deferred", "unchecked"):
            return f"{self.kind}: {self.violation}"
        measured = f"max|Δ|={self.max_abs:.3g} sqnr={self.sqnr_db:.1f}dB"
        return f"{self.kind} {'ok' if self.ok else 'BROKEN'} ({measured})"


SKIPPED = {"off": "not checked (verify=False)", "none": "no contract declared", "analysis": "analysis (no change)"}


def evaluate_contract(contract: NumericalContract, diff: OutputDiff) -> tuple[bool, dict[str, float], str]:
    """(held, limits applied, violation message) of ``contract`` given the measured ``diff``."""
    if contract.kind == "exact":
        bound = contract.atol + contract.rtol * diff.ref_max
        limits = {"atol": contract.atol, "rtol": contract.rtol}
        if diff.within(contract.atol, contract.rtol):
            return True, limits, ""
        return False, limits, (f"max abs diff {diff.max_abs:.6g} exceeds atol + rtol*max|ref| = {bound:.6g} "
                               f"(atol={contract.atol:g}, rtol={contract.rtol:g}, max|ref|={diff.ref_max:.6g})")
    limits, broken = {}, []
    if contract.max_abs is not None:
        limits["max_abs"] = contract.max_abs
        if not diff.max_abs <= contract.max_abs:
            broken.append(f"max abs diff {diff.max_abs:.6g} > max_abs {contract.max_abs:g}")
    if contract.min_sqnr_db is not None:
        limits["min_sqnr_db"] = contract.min_sqnr_db
        if not diff.sqnr_db >= contract.min_sqnr_db:
            broken.append(f"SQNR {diff.sqnr_db:.4g} dB < min_sqnr_db {contract.min_sqnr_db:g} dB")
    return not broken, limits, "; ".join(broken)


def state_fingerprint(graph: ForgeGraph) -> tuple[Any, ...]:
    """Identity and version counter of every parameter and buffer: changes when any is replaced or edited."""
    gm = graph.model
    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    return (id(gm.graph), len(gm.graph.nodes), tuple((n, id(t), t._version) for n, t in tensors))


def _detached(out: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


class OutputCache:
    """The batches to check on (materialised once) and the graph's latest outputs on them, per mode."""

    def __init__(self, graph: ForgeGraph, data: Any = None, num_batches: int | None = 1, seed: int = 0) -> None:
        self.batches = list(iter_batches(graph, data, num_batches))
        if not self.batches:
            raise ValueError("contract checks need at least one batch (the graph has no example inputs?)")
        self.seed = seed
        self.forwards = 0
        self._outputs: dict[str, list[Any]] = {}
        self._fingerprint: tuple[Any, ...] | None = None

    def run(self, graph: ForgeGraph, mode: str) -> list[Any]:
        """One forward per batch in ``mode`` (RNG forked and seeded, so train-mode runs are comparable)."""
        gm = graph.model
        was_training = gm.training
        gm.train(mode == "train")
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                outs = []
                for batch in self.batches:
                    torch.manual_seed(self.seed)
                    outs.append(_detached(run_batch(gm, batch)))
                    self.forwards += 1
        finally:
            gm.train(was_training)
        return outs

    def before(self, graph: ForgeGraph, mode: str) -> list[Any]:
        """Outputs before a step: the kept ones when the graph has not changed since, else a forward."""
        if self._fingerprint != state_fingerprint(graph) or mode not in self._outputs:
            self._outputs = {mode: self.run(graph, mode)}
            self._fingerprint = state_fingerprint(graph)
        return self._outputs[mode]

    def after(self, graph: ForgeGraph, mode: str) -> list[Any]:
        """Outputs after a step, kept as the next step's "before"."""
        self._outputs = {mode: self.run(graph, mode)}
        self._fingerprint = state_fingerprint(graph)
        return self._outputs[mode]

    def forget_if_changed(self, graph: ForgeGraph) -> None:
        if self._fingerprint != state_fingerprint(graph):
            self._outputs, self._fingerprint = {}, None


class ContractChecker:
    """Checks steps' contracts in order. When the graph cannot run right after a transform (e.g. static
    activation scales not calibrated yet), the check is deferred: the next step that leaves a runnable
    graph measures the joint error against the same "before" and judges every pending contract on it."""

    def __init__(self, graph: ForgeGraph, data: Any = None, num_batches: int | None = 1) -> None:
        self.cache = OutputCache(graph, data, num_batches)
        self._pending: list[tuple[int, str, NumericalContract]] = []
        self._before: list[Any] | None = None
        self._fwd0 = 0
        self._seconds = 0.0
        self._error = ""

    @property
    def forwards(self) -> int:
        return self.cache.forwards

    def before_step(self, graph: ForgeGraph, contract: NumericalContract | None) -> None:
        """Secure the outputs the step will be judged against (kept ones when possible)."""
        if contract is None or self._pending:
            return
        started, self._fwd0 = time.perf_counter(), self.cache.forwards
        self._before = self.cache.before(graph, contract.mode)
        self._seconds = time.perf_counter() - started

    def after_step(self, graph: ForgeGraph, index: int, name: str,
                   contract: NumericalContract | None) -> ContractResult | None:
        """The check after step ``index`` (pass ``name``); None when nothing was to be checked (caller says why).
        A violation names every step whose contract broke."""
        judged = [*self._pending, *([(index, name, contract)] if contract is not None else [])]
        if not judged:
            self.cache.forget_if_changed(graph)
            return None
        started = time.perf_counter()
        mode = judged[0][2].mode
        try:
            after = self.cache.after(graph, mode)
        except Exception as exc:  # the graph cannot run yet: judge it after a later step
            self._pending, self._error = judged, f"{type(exc).__name__}: {str(exc)[:200]}"
            self._seconds += time.perf_counter() - started
            return ContractResult(kind="deferred", ok=True, violation=f"graph not runnable yet ({self._error})")
        assert self._before is not None
        diffs = [compare_outputs(b, a) for b, a in zip(self._before, after)]
        worst = OutputDiff(max(d.max_abs for d in diffs), max(d.ref_max for d in diffs), min(d.sqnr_db for d in diffs))
        limits: dict[str, float] = {}
        broken = []
        for i, pass_name, c in judged:
            ok, lim, why = evaluate_contract(c, worst)
            limits.update(lim)
            if not ok:
                broken.append(f"step {i} ({pass_name}) {c.kind} contract: {why}")
        result = ContractResult(kind=judged[-1][2].kind, ok=not broken, max_abs=worst.max_abs, ref_max=worst.ref_max,
                                sqnr_db=worst.sqnr_db, limits=limits, violation="; ".join(broken),
                                forwards=self.cache.forwards - self._fwd0,
                                seconds=self._seconds + time.perf_counter() - started,
                                covers=tuple(i for i, _, _ in judged))
        self._pending, self._before = [], after
        return result

    def unfinished(self) -> tuple[tuple[int, ...], str]:
        """Steps whose check never ran (the graph never became runnable), and why."""
        return tuple(i for i, _, _ in self._pending), self._error
