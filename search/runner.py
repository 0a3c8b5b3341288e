"""Run a search: an Optuna study whose trials each evaluate one plan on a fresh copy of the base graph.

Every trial starts from ``base.copy()`` (or, for NAS, a freshly built and captured model), never from
the previous trial's graph; an identical plan already evaluated in the study (by any worker, before a
resume too) is not evaluated again — its values are reused, keyed by the plan's content. Nothing is
pickled into the study: a trial stores its plan as JSON, and results are rebuilt from it
(:mod:`fxforge.search.results`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from ..graph.forge_graph import ForgeGraph
from ..pipelines import Pipeline
from .checks import check_run_settings
from .errors import SearchError
from .fidelity import Fidelity, FidelityTask, RungWalk, fidelity_task
from .mlflow_log import MlflowTrialLog, mlflow_target
from .objectives import Constraint, Objective, measure_objectives, resolve_objectives
from .prefix_cache import PrefixCache, open_prefix_cache
from .priors import apply_prior, check_prior
from .progress import OptunaLogsAboveBar
from .samplers import PRUNERS, SAMPLERS, make_pruner, make_sampler, study_seed
from .space import SearchSpace, TrialPlan
from .storage import StorageSpec, batched_params, fail_stale_trials, open_storage
from .task import Task

__all__ = ["SAMPLERS", "PRUNERS", "Search", "apply_steps", "build_trial_graph", "plan_pipelines", "run_plan",
           "trial_pipeline"]

SPACE_ATTR, BASELINE_ATTR, OBJECTIVES_ATTR = "fxforge_space", "fxforge_baseline", "fxforge_objectives"
BASELINE_NOTES_ATTR = "fxforge_baseline_notes"  # how the baseline's values were measured (as a trial's "notes")
CONFIG_ATTR = "fxforge_config"


PLAN_ATTR, RESULT_ATTR = "fxforge_plan", "fxforge_result"


def trial_result(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """What fxforge recorded after evaluating a trial: values by objective, constraints, timing, cache hit."""
    return dict(trial.user_attrs.get(RESULT_ATTR, {}))


def trial_plan_key(trial: optuna.trial.FrozenTrial) -> str | None:
    return trial.user_attrs.get(PLAN_ATTR, {}).get("key")


def _set_constraints(trial: optuna.Trial, violations: Sequence[float]) -> None:
    """Tell the sampler how far the trial is from feasible (<= 0: feasible), one value per constraint."""
    for i, v in enumerate(violations):
        trial.set_constraint(str(i), float(v))


def trial_pipeline(steps: Sequence[tuple[str, Mapping[str, Any]]], name: str) -> Pipeline | None:
    """A trial's plan steps as a pipeline: pass names and args are validated when it is built (before any
    step runs or any training starts), and running it records a replayable entry in the graph's history."""
    return Pipeline([(step, dict(args)) for step, args in steps], name=name, verify=False) if steps else None


def calibrated(steps: Sequence[tuple[str, Mapping[str, Any]]], task: Task | None,
               graph: ForgeGraph) -> list[tuple[str, Mapping[str, Any]]]:
    """Plan steps with the task's calibration batches (and a cross-entropy loss) added by reference where a
    pass scores with data (pruning method ``taylor``) or observes ranges (quantizer calibration, which keeps
    the graph's example inputs when the task has no calibration data); the plan itself stays plain JSON."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    calib: tuple[list[dict[str, Any]], Any] | None = None
    for name, args in steps:
        weight = args.get("weight")
        if name == "prune_transform_pass" and isinstance(weight, Mapping) and weight.get("method") == "taylor" \
                and "data" not in args:
            if task is None:
                raise SearchError("pruning method 'taylor' scores with calibration batches: pass a task")
            if calib is None:
                calib = task.calibration(graph.model)
            args = {**args, "data": calib[0], "num_batches": len(calib[0]), "loss_fn": calib[1]}
        elif name in _CALIBRATE_PASSES and "data" not in args and task is not None:
            try:
                calib = calib or task.calibration(graph.model)
                args = {**args, "data": calib[0]}
            except SearchError:  # the task has no calibration data: the graph's example inputs calibrate
                pass
        out.append((name, args))
    return out


_CALIBRATE_PASSES = ("calibrate_transform_pass", "calibrate_analysis_pass")


def plan_pipelines(plan: TrialPlan, task: Task | None, graph: ForgeGraph,
                   label: str) -> tuple[Pipeline | None, Pipeline | None]:
    """The plan's steps before and after its fine-tune as pipelines on ``graph``, calibrated by ``task``
    (one place for a trial and for its rebuild, so both run the same thing)."""
    return (trial_pipeline(calibrated(plan.before_training(), task, graph), f"{label}: before training"),
            trial_pipeline(calibrated(plan.after_training(), task, graph), f"{label}: after training"))


def run_plan(graph: ForgeGraph, plan: TrialPlan, pipelines: tuple[Pipeline | None, Pipeline | None],
             task: Task | None, trial: optuna.Trial | None = None, cache: PrefixCache | None = None,
             notes: dict[str, Any] | None = None) -> ForgeGraph:
    """The plan on ``graph``: the steps before training, the fine-tune (reporting to ``trial`` if given),
    the steps after it (one place for a trial and for its rebuild). With ``cache`` the graph after the
    fine-tune comes from an entry of the same prefix when one exists (``notes["prefix_cache"]`` says so)."""
    before, after = pipelines

    def prefix(graph: ForgeGraph, trial: Any) -> ForgeGraph:
        graph = apply_steps(graph, before)
        if plan.train:
            if task is None:
                raise SearchError("this space fine-tunes every trial: pass a task that can train")
            task.train(graph, trial)
        return graph

    graph = cache.run(graph, plan, task, trial, prefix, notes) if cache is not None else prefix(graph, trial)
    return apply_steps(graph, after)


def apply_steps(graph: ForgeGraph, pipeline: Pipeline | None) -> ForgeGraph:
    """Run a trial pipeline on ``graph`` in place (the trial's graph is already a fresh copy)."""
    if pipeline is None:
        return graph
    graph, _ = pipeline(graph, inplace=True)
    return graph


def build_trial_graph(space: SearchSpace, plan: TrialPlan, base: ForgeGraph | None,
                      capture: Mapping[str, Any]) -> ForgeGraph:
    """The graph a trial starts from: a copy of the base graph, or (NAS) the sampled model captured."""
    if plan.model_config is None:
        if base is None:
            raise SearchError("this space starts from a base graph: pass base=ForgeGraph(...)")
        return base.copy()
    build = getattr(space, "build_model", None)
    if build is None:  # a joint space holding a NAS space
        build = next(s.build_model for s in getattr(space, "spaces", ()) if hasattr(s, "build_model"))
    # the trial owns the freshly built model: its graph shares the weights rather than copying them
    return ForgeGraph(build(plan.model_config, plan.identity_layers), **{"share_weights": True, **dict(capture)})


@dataclass
class Search:
    """A configured search; :meth:`run` creates (or resumes) the study and optimises it.

    Args:
        space: what to search (NASSpace, MixedPrecisionSpace, PruningSpace, LoRARankSpace, JointSpace).
        objectives: names from :data:`fxforge.search.objectives.OBJECTIVES` or Objective objects.
        base: the graph every trial copies (not needed by a pure NAS space).
        task: evaluation data (and training, for spaces that fine-tune).
        n_trials: the study's target count of finished (complete or pruned) trials.
        sampler / pruner: by name (samplers: tpe, nsga2, random, grid, gp; pruners: median,
            successive_halving, hyperband).
        storage: None (journal file in ``run_dir``), a journal path, ``sqlite:///…`` or ``postgresql://…``, or a
            StorageSpec (e.g. with another heartbeat interval and grace period).
        resume: continue an existing study of the same name and space (else an existing one is refused).
        constraints: e.g. ``[Constraint("accuracy", max_drop=0.01)]`` (feasible trials first in results).
        capture: ForgeGraph keyword arguments for NAS trials (e.g. ``{"hf_input_names": [...]}``).
        enqueue: parameter sets evaluated first (Optuna's ``enqueue_trial``), e.g. the configuration one would
            pick by hand, to compare with what the search finds; checked against the space before anything
            runs, and skipped on resume when the study already holds them.
        fidelity: a rung schedule (:class:`~fxforge.search.fidelity.Fidelity` or ``{"steps": [...],
            "eval_samples": [...]}``): each trial trains and is measured at growing budgets, reports each rung
            to the pruner (successive_halving / hyperband take their resources from it), and its value is the
            last rung's; ``task`` is then the given task seen at the last rung (``task.inner`` is the given one).
        mlflow: log one MLflow run per finished trial: True (an SQLite store in ``run_dir/mlflow``), a directory,
            ``sqlite:///FILE``, ``file:///DIR`` or a tracking server ``http(s)://HOST:PORT`` (search/mlflow_log.py).
        prefix_cache: where trials that differ only after their fine-tune share its result (search/prefix_cache.py):
            True (``run_dir/prefix-cache``), a directory, a PrefixCache (e.g. with another size cap), or None.
        fail_stale: on resume, fail (and re-queue) the trials a dead process left RUNNING; False for a process
            joining a journal study that other live processes run (the journal has no heartbeat to tell their
            trials from a dead process's; databases check heartbeats either way).
    """

    space: SearchSpace
    objectives: Sequence[str | Objective] = ("accuracy",)
    base: ForgeGraph | None = None
    task: Task | None = None
    n_trials: int = 20
    sampler: str = "tpe"
    pruner: str | None = None
    storage: str | StorageSpec | None = None
    study_name: str = "fxforge"
    run_dir: str | Path = "fxforge-search"
    resume: bool = False
    constraints: Sequence[Constraint] = ()
    capture: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = 0
    worker: int | None = None  # this process's index among workers sharing the study (seeds its sampler apart)
    progress: bool = True
    timeout: float | None = None
    on_trial: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None
    config_json: str | None = None
    enqueue: Sequence[Mapping[str, Any]] = ()
    fidelity: Fidelity | Mapping[str, Any] | None = None
    mlflow: bool | str | None = None
    prefix_cache: str | Path | PrefixCache | bool | None = True
    fail_stale: bool = True

    def __post_init__(self) -> None:
        self._objectives = resolve_objectives(self.objectives)
        check_run_settings(self.n_trials, self.seed, self.timeout, self.study_name, self._objectives, self.task)
        if self.worker is not None and (type(self.worker) is not int or self.worker < 0):
            raise SearchError(f"worker must be None or an integer >= 0, got {self.worker!r}")
        names = {o.name for o in self._objectives}
        for c in self.constraints:
            if c.objective not in names:
                raise SearchError(f"constraint on {c.objective!r}, which is not an objective ({sorted(names)})")
        if self.sampler not in SAMPLERS:
            raise SearchError(f"unknown sampler {self.sampler!r}; choose from {list(SAMPLERS)}")
        self.task, self._fidelity = fidelity_task(self.task, self.fidelity, self._objectives)
        self.fidelity = self._fidelity
        make_pruner(self.pruner, self._fidelity)  # a schedule Optuna's rungs cannot follow: refused here
        if self.pruner not in (None, "none") and len(self._objectives) > 1:
            raise SearchError("pruners need a single objective (Optuna cannot report intermediate values of a "
                              "multi-objective trial); drop the pruner or keep one objective")
        if self.space.needs_graph and self.base is None:
            raise SearchError(f"a {self.space.kind} space starts every trial from a base graph: pass base=")
        self.run_dir = Path(self.run_dir)
        self._prefix_cache = open_prefix_cache(self.prefix_cache, self.run_dir, self.base)
        self.storage_spec().check_file(self.run_dir)  # a malformed URL or unwritable file: refused before any trial
        self._mlflow = mlflow_target(self.mlflow, self.run_dir)  # a bad tracking URI: refused before any trial
        self._bound = self.space.bind(self.base)
        check_prior(self._bound, self.task)  # prior="sensitivity" measures on the task's calibration batches
        self._baseline: dict[str, float] = {}
        self._finished = _Finished(self.n_trials)
        self.enqueue = tuple(self._checked_enqueue(p) for p in self.enqueue)

    def _checked_enqueue(self, params: Any) -> dict[str, Any]:
        """``params`` if the space samples exactly these names, each from its choices; SearchError otherwise."""
        import warnings

        if not isinstance(params, Mapping):
            raise SearchError(f"enqueue: each entry must be a dict of parameters, got {type(params).__name__}")
        trial = optuna.trial.FixedTrial(dict(params))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                self._bound.suggest(trial)
        except optuna.TrialPruned as exc:
            raise SearchError(f"enqueue: {dict(params)} is an invalid combination ({exc})") from None
        except (ValueError, UserWarning) as exc:
            raise SearchError(f"enqueue: {dict(params)} does not fit the space: {exc}") from None
        unused = sorted(set(params) - set(trial.params))
        if unused:
            raise SearchError(f"enqueue: the space samples no parameter(s) {unused}; it samples "
                              f"{sorted(trial.params)}")
        return dict(params)

    # -- study ----------------------------------------------------------------------------------------
    def open_study(self) -> optuna.Study:
        """Create or (with ``resume``) load the study; refuses a clash of name, space or objectives."""
        where = self.storage_spec()
        storage = open_storage(where, Path(self.run_dir))
        directions = [o.direction for o in self._objectives]
        existing = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
        spec = json.dumps(self._bound_spec(), sort_keys=True)
        objectives = [o.name for o in self._objectives]
        if self.study_name in existing:
            held = len(storage.get_all_trials(storage.get_study_id_from_name(self.study_name), deepcopy=False))
            study = optuna.load_study(study_name=self.study_name, storage=storage,
                                      sampler=self._make_sampler(held), pruner=make_pruner(self.pruner, self._fidelity))
            if study.user_attrs.get(SPACE_ATTR) not in (None, spec):
                raise SearchError(f"study {self.study_name!r} exists with a different search space; "
                                  "choose another study_name (or run_dir)")
            if study.user_attrs.get(OBJECTIVES_ATTR) not in (None, objectives):
                raise SearchError(f"study {self.study_name!r} exists with objectives "
                                  f"{study.user_attrs[OBJECTIVES_ATTR]}, not {objectives}")
            if not self.resume:
                raise SearchError(f"study {self.study_name!r} already exists ({len(study.trials)} trials); "
                                  "pass resume=True to continue it, or choose another study_name")
            if self.fail_stale or where.kind != "journal":
                fail_stale_trials(study, storage, where)  # what a killed process left RUNNING: failed, re-queued
            return study
        study = optuna.create_study(storage=storage, study_name=self.study_name, directions=directions,
                                    sampler=self._make_sampler(0), pruner=make_pruner(self.pruner, self._fidelity))
        study.set_user_attr(SPACE_ATTR, spec)
        study.set_user_attr(OBJECTIVES_ATTR, objectives)
        if self.config_json is not None:
            study.set_user_attr(CONFIG_ATTR, self.config_json)
        return study

    def storage_spec(self) -> StorageSpec:
        """Where the study lives (``storage`` as given, or a StorageSpec of the URL or path)."""
        return self.storage if isinstance(self.storage, StorageSpec) else StorageSpec(self.storage)

    def _bound_spec(self) -> dict[str, Any]:
        return self.space.to_spec()

    def _make_sampler(self, n_existing: int) -> optuna.samplers.BaseSampler:
        """The sampler for a study holding ``n_existing`` trials: seeded so a resume draws new points, and so
        concurrent workers draw different ones."""
        return make_sampler(self.sampler, study_seed(self.seed, n_existing, self.worker))

    def baseline(self, study: optuna.Study) -> dict[str, float]:
        """Objectives of the base graph, measured once per study (stored in it for resumes and workers)."""
        stored = study.user_attrs.get(BASELINE_ATTR)
        if stored is not None:
            return dict(stored)
        if self.base is None:
            return {}
        values, notes = measure_objectives(self._objectives, self.base, self.task)
        study.set_user_attr(BASELINE_ATTR, values)
        if notes:
            study.set_user_attr(BASELINE_NOTES_ATTR, notes)
        return values

    # -- trials ---------------------------------------------------------------------------------------
    def start_graph(self, plan: TrialPlan) -> ForgeGraph:
        """The graph a trial of ``plan`` starts from (see build_trial_graph), with the space bound to the base."""
        return build_trial_graph(self._bound, plan, self.base, self.capture)

    def evaluate(self, trial: optuna.Trial) -> list[float]:
        """Sample a plan, reuse an identical finished plan's values, else build, run and measure it."""
        t0 = time.perf_counter()
        with batched_params(trial):  # parameters and plan in one write, before any work: replayable if we die
            plan = self._bound.suggest(trial)
            key = plan.key()
            trial.set_user_attr(PLAN_ATTR, {"key": key, **plan.to_json()})
        cached = self._finished.plans.get(key)
        if cached is not None:
            trial.set_user_attr(RESULT_ATTR, {**trial_result(cached), "cached_from": cached.number})
            _set_constraints(trial, trial_result(cached).get("constraints", []))
            return list(cached.values)
        t1 = time.perf_counter()
        graph = self.start_graph(plan)
        pipelines = plan_pipelines(plan, self.task, graph, f"trial {trial.number}")
        t2 = time.perf_counter()
        # with a fidelity, the walk trains at the rungs' budgets and reports each rung; its last is the value
        walk = (RungWalk(self.task, self._objectives, trial, pipelines[1], self.pruner, plan.train)
                if isinstance(self.task, FidelityTask) else None)
        ran: dict[str, Any] = {}  # e.g. ran["prefix_cache"]: "hit" or "miss"
        try:
            graph = run_plan(graph, plan, pipelines, walk.task if walk else self.task,
                             trial if len(self._objectives) == 1 else None, self._prefix_cache, ran)
            t3 = time.perf_counter()
            values, notes = walk.finish(graph) if walk else measure_objectives(self._objectives, graph, self.task)
        except optuna.TrialPruned:
            if walk is not None:  # the rungs measured, and at which one the pruner stopped it and why
                trial.set_user_attr(RESULT_ATTR, walk.result())
            raise
        t4 = time.perf_counter()
        result: dict[str, Any] = {"values": values, **ran,
                                  "timing_s": {"sample": t1 - t0, "build": t2 - t1, "run": t3 - t2, "measure": t4 - t3}}
        if walk is not None:
            result["rungs"] = walk.rungs
        if notes:  # e.g. notes["latency_ms"]["timed"]: "lowered" or "simulated"
            result["notes"] = notes
        if self.constraints:
            result["constraints"] = [c.violation(values, self._baseline) for c in self.constraints]
            _set_constraints(trial, result["constraints"])
        trial.set_user_attr(RESULT_ATTR, result)
        return [values[o.name] for o in self._objectives]

    def run(self) -> Any:
        """Optimise until the study holds ``n_trials`` finished trials; returns a SearchResult."""
        from .results import SearchResult

        study = self.open_study()
        # a sensitivity prior shapes the space from the study's (stored, else measured once) sensitivity and
        # seeds it with ranked allocations; the given enqueue is checked again against the shaped space
        self._bound, seeded = apply_prior(self._bound, study, self.base, self.task)
        for params in (*seeded, *[self._checked_enqueue(p) for p in self.enqueue]):
            study.enqueue_trial(dict(params), skip_if_exists=True)  # checked dicts; Optuna types it dict
        self._baseline = self.baseline(study)
        callbacks: list[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = [self._finished]
        if self.on_trial is not None:
            callbacks.append(self.on_trial)
        done = self._finished.refresh(study)
        logging = (MlflowTrialLog(self, study, self._mlflow, [o.name for o in self._objectives], self._baseline)
                   if self._mlflow else None)  # mlflow=: one MLflow run per trial
        with logging if logging is not None else nullcontext([]) as logged:
            if done < self.n_trials:
                with _progress(self, study, done) as bar:
                    study.optimize(self.evaluate, n_trials=None, timeout=self.timeout,
                                   callbacks=[*callbacks, *logged, bar])
        return SearchResult(study, [o.name for o in self._objectives], self._baseline, self)


class _Finished:
    """One read of the study's finished trials after each trial: it stops the study at ``n_trials`` (what
    Optuna's MaxTrialsCallback does with a read of its own) and refreshes the plan cache the next trial
    looks up, instead of a third read of the study per trial. With several workers a plan finished
    elsewhere in the few milliseconds since the read is evaluated again: slower, never wrong."""

    def __init__(self, n_trials: int) -> None:
        self.n_trials = n_trials
        self.plans: dict[str, optuna.trial.FrozenTrial] = {}

    def refresh(self, study: optuna.Study) -> int:
        trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                          optuna.trial.TrialState.PRUNED))
        for t in trials:
            key = trial_plan_key(t)
            if t.state == optuna.trial.TrialState.COMPLETE and key is not None:
                self.plans.setdefault(key, t)
        return len(trials)

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if self.refresh(study) >= self.n_trials:
            study.stop()


class _progress:
    """A tqdm bar of finished trials with the best value so far (a no-op when progress is off)."""

    def __init__(self, search: Search, study: optuna.Study, done: int) -> None:
        self.search, self.study, self.done = search, study, done
        self.bar: Any = None

    def __enter__(self) -> _progress:
        if self.search.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.search.n_trials, initial=self.done, desc=f"search {self.search.study_name}",
                            unit="trial", leave=True)
        self.logs = OptunaLogsAboveBar(self.bar).__enter__()  # Optuna's lines above the bar, no Trainer bars
        return self

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if trial.values is not None and len(trial.values) == 1:
            try:
                self.bar.set_postfix(best=f"{study.best_value:.4g}")
            except ValueError:
                pass
        elif trial.values is not None:
            self.bar.set_postfix(pareto=len(study.best_trials))

    def __exit__(self, *exc: object) -> None:
        self.logs.__exit__(None, None, None)
        if self.bar is not None:
            self.bar.close()
