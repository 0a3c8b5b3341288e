"""Multi-fidelity trials: a rung schedule of growing budgets, and how one trial walks it.

A :class:`Fidelity` lists, per rung, the fine-tune steps a trial has trained for and the held-out samples
it is measured on, e.g. ``Fidelity(steps=(50, 150, 450), eval_samples=(100, 250, 500))``. A trial that
fine-tunes trains once to the last rung's steps and is measured at each earlier rung on the way; a trial
that does not fine-tune (post-training quantization only) is measured on the first ``eval_samples[k]``
samples per rung. Each rung's value is reported to Optuna at the rung's budget (its steps when the schedule
has steps, else its eval samples: one axis for every trial of a study, so the pruner compares like with
like), and a trial the pruner stops raises ``optuna.TrialPruned``; the trial's value is the last rung's.

Optuna's successive-halving and Hyperband pruners compare trials at budgets ``min_resource * eta**k``:
:attr:`Fidelity.reduction_factor` is that ``eta`` when the budgets are geometric, so the pruner's rungs
are exactly the schedule's (search/samplers.py builds them from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import SearchError
from .objectives import Objective, measure_objectives
from .task import Batch, Task

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph
    from ..pipelines import Pipeline

__all__ = ["Fidelity", "FidelityTask", "RungWalk", "fidelity_task"]

_KEYS = ("steps", "eval_samples")


def _schedule(name: str, values: Any) -> tuple[int, ...]:
    """``values`` as a tuple of positive, strictly increasing integers (empty allowed: the axis is unused)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise SearchError(f"fidelity {name} must be a list of integers, got {values!r}")
    out = tuple(values)
    bad = [v for v in out if type(v) is not int or v < 1]
    if bad:
        raise SearchError(f"fidelity {name} must be positive integers, got {bad} in {list(out)}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise SearchError(f"fidelity {name} must be strictly increasing (a rung's budget grows), got {list(out)}")
    return out


@dataclass(frozen=True)
class Fidelity:
    """Per rung: fine-tune ``steps`` reached and held-out ``eval_samples`` measured (either may be empty)."""

    steps: tuple[int, ...] = ()
    eval_samples: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse an empty, non-positive or non-increasing schedule, and axes of different rung counts."""
        steps, samples = _schedule("steps", self.steps), _schedule("eval_samples", self.eval_samples)
        if not steps and not samples:
            raise SearchError("fidelity needs steps or eval_samples (one budget per rung), got neither")
        if steps and samples and len(steps) != len(samples):
            raise SearchError(f"fidelity steps {list(steps)} and eval_samples {list(samples)} must have one entry "
                              "per rung (the same length)")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "eval_samples", samples)

    @classmethod
    def from_spec(cls, spec: Fidelity | Mapping[str, Any]) -> Fidelity:
        """A Fidelity from itself or a ``{"steps": [...], "eval_samples": [...]}`` table (unknown keys refused)."""
        if isinstance(spec, Fidelity):
            return spec
        if not isinstance(spec, Mapping):
            raise SearchError(f"fidelity must be a table with {list(_KEYS)}, got {type(spec).__name__}")
        bad = sorted(set(spec) - set(_KEYS))
        if bad:
            raise SearchError(f"fidelity: unknown key(s) {bad}; allowed: {list(_KEYS)}")
        return cls(**{k: spec[k] for k in _KEYS if k in spec})

    def to_json(self) -> dict[str, list[int]]:
        return {k: list(getattr(self, k)) for k in _KEYS if getattr(self, k)}

    @property
    def n_rungs(self) -> int:
        return len(self.steps or self.eval_samples)

    def budget(self, rung: int) -> int:
        """The step rung ``rung`` reports at: its fine-tune steps, or its eval samples without steps."""
        return (self.steps or self.eval_samples)[rung]

    def samples(self, rung: int) -> int | None:
        """Held-out samples rung ``rung`` is measured on (None: all of the task's)."""
        return self.eval_samples[rung] if self.eval_samples else None

    @property
    def reduction_factor(self) -> int:
        """The integer ``eta`` with ``budget(k) == budget(0) * eta**k`` (what Optuna's successive-halving and
        Hyperband rungs are); SearchError for a schedule that is not such a geometric series."""
        budgets = self.steps or self.eval_samples
        axis = "steps" if self.steps else "eval_samples"
        if len(budgets) < 2:
            raise SearchError(f"successive halving needs at least 2 rungs to stop a trial early, got {axis} "
                              f"{list(budgets)}")
        eta, rest = divmod(budgets[1], budgets[0])
        if rest or eta < 2 or any(b != budgets[0] * eta ** k for k, b in enumerate(budgets)):
            raise SearchError(f"Optuna's successive-halving / Hyperband rungs are min_resource * eta**k: fidelity "
                              f"{axis} {list(budgets)} is not such a series with an integer eta >= 2 (e.g. "
                              f"{[budgets[0] * 3 ** k for k in range(len(budgets))]}); or use pruner 'median'")
        return eta


def _first(batches: Sequence[Batch], n: int) -> list[Batch]:
    """The first ``n`` samples of ``batches`` (the last batch cut to fit)."""
    out: list[Batch] = []
    left = n
    for inputs, labels in batches:
        if left <= 0:
            break
        m = int(labels.shape[0])
        out.append((inputs, labels) if m <= left else ({k: v[:left] for k, v in inputs.items()}, labels[:left]))
        left -= m
    return out


def eval_count(task: Task) -> int:
    return sum(int(labels.shape[0]) for _, labels in task.eval_batches())


class FidelityTask(Task):
    """``inner`` at a fidelity schedule's final budget: it trains to the last rung's steps and evaluates on
    the last rung's samples (what a trial's value, the baseline and a rebuilt point are measured with).
    :meth:`at` gives the view of one rung's samples; a :class:`RungWalk` makes it report at each rung."""

    def __init__(self, inner: Task, fidelity: Fidelity, samples: int | None = None,
                 walk: RungWalk | None = None) -> None:
        self.inner, self.fidelity, self.walk = inner, fidelity, walk
        self._samples = samples if samples is not None else fidelity.samples(-1)
        self._views: dict[int, FidelityTask] = {}
        self._eval: list[Batch] | None = None

    def at(self, samples: int | None) -> FidelityTask:
        """This task measured on the first ``samples`` held-out samples (None: the final rung's)."""
        if samples is None or samples == self._samples:
            return self
        if samples not in self._views:
            self._views[samples] = FidelityTask(self.inner, self.fidelity, samples)
        return self._views[samples]

    def eval_batches(self) -> Sequence[Batch]:
        if self._samples is None:
            return self.inner.eval_batches()
        if self._eval is None:
            self._eval = _first(self.inner.eval_batches(), self._samples)
        return self._eval

    def calibration_batches(self) -> Sequence[Batch]:
        return self.inner.calibration_batches()

    def train(self, graph: ForgeGraph, trial: optuna.Trial | None, steps: int | None = None,
              checkpoints: Sequence[int] = (), on_checkpoint: Callable[[int], None] | None = None) -> None:
        """Train to the schedule's last steps (the task's own length without steps), stopping at each earlier
        rung's steps for the walk's measurement when a walk is attached."""
        steps = steps if steps is not None else (self.fidelity.steps[-1] if self.fidelity.steps else None)
        walk = self.walk
        if walk is not None and walk.reporting and self.fidelity.steps:
            walk.graph = graph
            checkpoints, on_checkpoint = self.fidelity.steps[:-1], walk.at_step
        self.inner.train(graph, None, steps=steps, checkpoints=checkpoints, on_checkpoint=on_checkpoint)


def fidelity_task(task: Task | None, fidelity: Fidelity | Mapping[str, Any] | None,
                  objectives: Sequence[Objective]) -> tuple[Task | None, Fidelity | None]:
    """The search's task seen at the schedule's final budget, and the checked schedule (both unchanged without
    a fidelity); SearchError for a schedule the task cannot serve."""
    if fidelity is None:
        return task, None
    fid = Fidelity.from_spec(fidelity)
    if isinstance(task, FidelityTask):
        task = task.inner
    if task is None:
        raise SearchError("fidelity trains and evaluates each rung on a task: pass task=")
    if getattr(task, "report_every", 0):
        raise SearchError("the task's report_every and a fidelity both report intermediate values to the pruner: "
                          "set report_every = 0 (the fidelity's rungs report) or drop the fidelity")
    if fid.eval_samples:
        held = eval_count(task)
        if fid.eval_samples[-1] > held:
            raise SearchError(f"fidelity eval_samples {list(fid.eval_samples)}: the task holds {held} held-out "
                              "samples; the last rung cannot measure more")
    return FidelityTask(task, fid), fid


class RungWalk:
    """One trial's walk up the rungs: measure, report to ``trial`` (None: a multi-objective trial, which
    Optuna cannot prune, measured at the last rung only), stop when the pruner says so.

    ``after`` is the plan's pipeline after training: an intermediate rung of a trained trial measures a
    copy of the graph with it applied, so each rung measures what the finished trial would be."""

    def __init__(self, task: FidelityTask, objectives: Sequence[Objective], trial: optuna.Trial | None,
                 after: Pipeline | None, pruner: str | None, trains: bool) -> None:
        self.fidelity, self.objectives, self.trial, self.after = task.fidelity, objectives, trial, after
        # a trial that trains to a schedule's steps walks the earlier rungs while training (none when the
        # prefix cache serves its fine-tune: the trained model measured at an earlier rung would mislead)
        self.walks_in_training = trains and bool(task.fidelity.steps)
        self.pruner = pruner or "none"
        self.reporting = trial is not None and len(objectives) == 1
        self.measured = task  # shares its per-rung views of the held-out samples across trials
        self.task = FidelityTask(task.inner, task.fidelity, walk=self)  # what run_plan trains the trial with
        self.graph: ForgeGraph | None = None
        self.rungs: list[dict[str, Any]] = []
        self.pruned: dict[str, Any] | None = None

    def at_step(self, step: int) -> None:
        """Called by the task's training at an intermediate rung's steps."""
        if self.graph is None:
            raise SearchError("RungWalk.at_step called outside its task's training")
        rung = self.fidelity.steps.index(step)
        graph = self.after(self.graph)[0] if self.after is not None else self.graph
        self._report(rung, self._measure(graph, rung)[0])

    def finish(self, graph: ForgeGraph) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """The rungs not walked in training, on the finished graph: every rung by eval samples for a trial that
        did not train to the schedule's steps, else the last; returns the last rung's values and notes (the
        trial's result)."""
        last = self.fidelity.n_rungs - 1
        by_samples = self.reporting and self.fidelity.eval_samples and not self.walks_in_training
        for rung in range(0 if by_samples else last, last):
            self._report(rung, self._measure(graph, rung)[0])
        values, notes = self._measure(graph, last)
        self._report(last, values, final=True)
        return values, notes

    def result(self) -> dict[str, Any]:
        """The rungs measured (and, when pruned, at which rung and why) for the trial's result attrs."""
        out: dict[str, Any] = {"rungs": list(self.rungs)}
        if self.pruned is not None:
            out["pruned"] = dict(self.pruned)
        return out

    def _judged(self) -> str:
        """What the pruner found wrong with a value it stopped (its rule in a phrase)."""
        if self.pruner in ("successive_halving", "hyperband"):
            return f"not in the top 1/{self.fidelity.reduction_factor} of the trials measured at that rung"
        if self.pruner == "median":
            return "worse than the median of the other trials at that budget"
        return "judged hopeless by the pruner"

    def _measure(self, graph: ForgeGraph, rung: int) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        return measure_objectives(self.objectives, graph, self.measured.at(self.fidelity.samples(rung)))

    def _report(self, rung: int, values: Mapping[str, float], final: bool = False) -> None:
        import optuna

        fid = self.fidelity
        entry = {"rung": rung, "step": fid.budget(rung),
                 "train_steps": fid.steps[rung] if self.walks_in_training else None,
                 "eval_samples": fid.samples(rung), "values": dict(values)}
        self.rungs.append(entry)
        if not self.reporting or self.trial is None:
            return
        name = self.objectives[0].name
        value = float(values[name])
        self.trial.report(value, step=fid.budget(rung))
        if final or not self.trial.should_prune():
            return
        where = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in entry.items()
                          if k in ("train_steps", "eval_samples") and v is not None)
        reason = (f"pruner {self.pruner!r} stopped the trial at rung {rung} of {fid.n_rungs} ({where}): {name} "
                  f"{value:.4g} was {self._judged()}")
        self.pruned = {"rung": rung, "step": fid.budget(rung), "objective": name, "value": value,
                       "pruner": self.pruner, "reason": reason}
        raise optuna.TrialPruned(reason)
