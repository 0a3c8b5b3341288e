"""What a search found: the Pareto front (or best trial) as a table, JSON and CSV, plots, checkpoints.

Graphs are never pickled into the study: each point's graph is rebuilt from the plan its trial stored
(a copy of the base graph through the same pipeline steps, or the same NAS configuration captured and
fine-tuned again) and exported as an fxforge checkpoint.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from .runner import PLAN_ATTR, trial_plan_key, trial_result
from .space import TrialPlan

if TYPE_CHECKING:
    from ..graph.forge_graph import ForgeGraph
    from .runner import Search

__all__ = ["SearchResult", "pareto_front"]


def _dominates(a: Sequence[float], b: Sequence[float], signs: Sequence[float]) -> bool:
    better_or_equal = all(s * x >= s * y for x, y, s in zip(a, b, signs))
    return better_or_equal and any(s * x > s * y for x, y, s in zip(a, b, signs))


def pareto_front(trials: Sequence[optuna.trial.FrozenTrial],
                 directions: Sequence[str]) -> list[optuna.trial.FrozenTrial]:
    """Non-dominated complete trials (``directions``: maximize/minimize per value); duplicates kept once."""
    signs = [1.0 if d == "maximize" else -1.0 for d in directions]
    front, seen = [], set()
    for t in trials:
        if t.values is None or any(_dominates(o.values, t.values, signs) for o in trials if o.values is not None):
            continue
        key = trial_plan_key(t) or t.number
        if key not in seen:
            seen.add(key)
            front.append(t)
    return sorted(front, key=lambda t: [-s * v for s, v in zip(signs, t.values)])


def _objective_value(trial: optuna.trial.FrozenTrial, index: int) -> float:
    """The trial's ``index``-th objective value (a plot's target; trials without values are not plotted)."""
    return float(trial.values[index])


def _feasible(t: optuna.trial.FrozenTrial) -> bool:
    return all(c <= 0 for c in trial_result(t).get("constraints", [0.0]))


class SearchResult:
    """A finished (or resumed) study with its objective names, the baseline and the search that ran it."""

    def __init__(self, study: optuna.Study, objectives: Sequence[str], baseline: Mapping[str, float],
                 search: Search | None = None) -> None:
        self.study, self.objectives, self.baseline, self.search = study, list(objectives), dict(baseline), search

    @property
    def directions(self) -> list[str]:
        return ["maximize" if d == optuna.study.StudyDirection.MAXIMIZE else "minimize" for d in self.study.directions]

    def completed(self) -> list[optuna.trial.FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))

    def front(self) -> list[optuna.trial.FrozenTrial]:
        """The Pareto front of feasible trials (all trials when none is feasible), best first."""
        done = self.completed()
        feasible = [t for t in done if _feasible(t)] or done
        return pareto_front(feasible, self.directions)

    def rows(self, trials: Sequence[optuna.trial.FrozenTrial] | None = None) -> list[dict[str, Any]]:
        """One JSON-able row per trial: number, values by objective, feasibility, params, cache hit."""
        out = []
        for t in self.front() if trials is None else trials:
            row: dict[str, Any] = {"trial": t.number, "state": t.state.name}
            for name, v in zip(self.objectives, t.values or [None] * len(self.objectives)):
                row[name] = v
            row["feasible"] = _feasible(t)
            row["cached"] = "cached_from" in trial_result(t)
            row["params"] = dict(t.params)
            out.append(row)
        return out

    def _repr_html_(self) -> str | None:
        """Jupyter: the interactive search page, framed (the view report/notebook.py registers; None: plain repr)."""
        from ..graph.html_view import html_view

        return html_view(self)

    def table(self) -> str:
        """The front as an aligned text table with the baseline on top."""
        header = ["trial", *self.objectives, "feasible"]
        lines = [header]
        if self.baseline:
            lines.append(["base", *(_fmt(self.baseline.get(o)) for o in self.objectives), "-"])
        for r in self.rows():
            lines.append([str(r["trial"]), *(_fmt(r[o]) for o in self.objectives), "yes" if r["feasible"] else "no"])
        widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
        return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in lines)

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)  # as the CLI's check of --results allows
        doc = {"study": self.study.study_name, "objectives": self.objectives, "directions": self.directions,
               "baseline": self.baseline, "front": self.rows(), "trials": self.rows(self.study.trials)}
        path.write_text(json.dumps(_strict(doc), indent=1, default=str, allow_nan=False))  # what the report reads
        return path

    def to_csv(self, path: str | Path) -> Path:
        path = Path(path)
        rows = self.rows()
        params = sorted({k for r in rows for k in r["params"]})
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["trial", *self.objectives, "feasible", *params])
            for r in rows:
                w.writerow([r["trial"], *(r[o] for o in self.objectives), r["feasible"],
                            *(r["params"].get(p, "") for p in params)])
        return path

    def plots(self, out_dir: str | Path) -> list[Path]:
        """Self-contained HTML (plotly, JS inlined: no network) and PNG (matplotlib) plots."""
        import optuna.visualization as vis

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        figures: dict[str, Any] = {}
        if len(self.objectives) > 1:
            figures["pareto_front"] = vis.plot_pareto_front(self.study, target_names=self.objectives)
            bits = next((o for o in self.objectives if "bits" in o or "bytes" in o), None)
            if "accuracy" in self.objectives and bits:
                figures["accuracy_vs_bits"] = self._scatter("accuracy", bits)
        else:
            figures["optimization_history"] = vis.plot_optimization_history(self.study)
        for i, name in enumerate(self.objectives):
            figures[f"history_{name}"] = vis.plot_optimization_history(
                self.study, target=functools.partial(_objective_value, index=i), target_name=name)
        for name, fig in figures.items():
            path = out / f"{name}.html"
            fig.write_html(str(path), include_plotlyjs=True, full_html=True)
            written.append(path)
        written.extend(self._pngs(out))
        return written

    def _scatter(self, y: str, x: str) -> Any:
        import plotly.graph_objects as go

        rows = self.rows(self.completed())
        front = {r["trial"] for r in self.rows()}
        fig = go.Figure()
        for on_front in (False, True):
            pts = [r for r in rows if (r["trial"] in front) == on_front]
            fig.add_trace(go.Scatter(x=[r[x] for r in pts], y=[r[y] for r in pts], mode="markers",
                                     name="Pareto front" if on_front else "trials",
                                     text=[f"trial {r['trial']}" for r in pts]))
        fig.update_layout(xaxis_title=x, yaxis_title=y, title=f"{y} vs {x}")
        return fig

    def _pngs(self, out: Path) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows(self.completed())
        written = []
        for name in self.objectives:
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.plot([r["trial"] for r in rows], [r[name] for r in rows], "o", label="trial")
            ax.set_xlabel("trial")
            ax.set_ylabel(name, parse_math=False)  # objective names are never parsed as matplotlib math
            ax.set_title(f"{name} per trial", parse_math=False)
            written.append(_save(plt, fig, out / f"history_{name}.png"))
        if len(self.objectives) > 1:
            a, b = self.objectives[0], self.objectives[1]
            front = {r["trial"] for r in self.rows()}
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.scatter([r[b] for r in rows], [r[a] for r in rows], c=["C1" if r["trial"] in front else "C0"
                                                                     for r in rows])
            ax.set_xlabel(b, parse_math=False)
            ax.set_ylabel(a, parse_math=False)
            ax.set_title(f"{a} vs {b} (orange: Pareto front)", parse_math=False)
            written.append(_save(plt, fig, out / f"pareto_{a}_vs_{b}.png"))
        return written

    def rebuild(self, trial: optuna.trial.FrozenTrial) -> ForgeGraph:
        """The trial's graph rebuilt from its stored plan (same steps on a fresh copy / a new NAS model)."""
        from .runner import plan_pipelines, run_plan

        if self.search is None:
            raise ValueError("rebuilding needs the Search that ran the study")
        plan = plan_from_json(trial.user_attrs[PLAN_ATTR])
        graph = self.search.start_graph(plan)
        return run_plan(graph, plan, plan_pipelines(plan, self.search.task, graph, f"trial {trial.number}"),
                        self.search.task)

    def export(self, out_dir: str | Path, trials: Sequence[optuna.trial.FrozenTrial] | None = None) -> list[Path]:
        """Rebuild each front point (or the given trials) and export it as a checkpoint ``trial_<n>``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for t in self.front() if trials is None else trials:
            paths.append(self.rebuild(t).export(out / f"trial_{t.number}"))
            self._check_size(t, paths[-1])
        return paths

    def _check_size(self, trial: optuna.trial.FrozenTrial, path: Path) -> None:
        """Warn when an exported point's weights file is not the size its trial measured (``checkpoint_bytes``):
        the rebuild is not the graph the search measured (another base graph, or a study measured before
        checkpoints stored quantized weights packed), so its row's size is not this checkpoint's."""
        if "checkpoint_bytes" not in self.objectives or trial.values is None:
            return
        import warnings

        from .measured import checkpoint_weight_bytes

        measured = trial.values[self.objectives.index("checkpoint_bytes")]
        on_disk = checkpoint_weight_bytes(path)
        if on_disk != measured:
            warnings.warn(f"trial {trial.number}: the exported checkpoint {path} holds {on_disk} bytes of weights, "
                          f"the trial measured {measured:.0f}: this rebuild is not the graph the search measured "
                          "(another base graph, or a study measured by an older fxforge)", stacklevel=3)


def plan_from_json(doc: Mapping[str, Any]) -> TrialPlan:
    steps = tuple((str(name), dict(args)) for name, args in doc["steps"])
    return TrialPlan(steps, bool(doc["train"]), doc.get("model_config"), tuple(doc.get("identity_layers", ())),
                     qat=doc.get("qat", False) is True)


def _strict(value: Any) -> Any:
    """``value`` with non-finite floats as text ("nan", "inf"): strict JSON, which the report's reader requires."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) >= 1e4:
        return f"{int(v):,}"  # counts (checkpoint_bytes, weight_bits, param_count) in full, not as 1.155e+07
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Write one matplotlib figure as a PNG and release it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
