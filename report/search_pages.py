"""The search page: an interactive Pareto front (plotly, its JavaScript inlined once: offline, no CDN), the
table of every trial linked both ways to its point, and parameter importances per objective
(``optuna.importance.get_param_importances``, fANOVA with a fixed seed).

It reads a SearchResult (its Optuna study) or the results JSON ``fxforge search --results`` writes (checked
by report/search_json first). From JSON the study is rebuilt in memory for the importances: each parameter's
distribution spans the values its trials took (ints and floats as ranges, anything else as categories), which
is all fANOVA reads of it. The data reaches the page as one JSON block (``<`` and ``>`` escaped), never as code.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .search_json import check_search_results

if TYPE_CHECKING:
    import optuna


@runtime_checkable
class SearchResult(Protocol):
    """What the page reads of fxforge.search.SearchResult (report/ builds on passes only: it never imports search)."""

    study: optuna.Study
    objectives: list[str]
    baseline: dict[str, float]

    @property
    def directions(self) -> list[str]: ...

    def rows(self, trials: Any = None) -> list[dict[str, Any]]: ...

__all__ = ["SearchResult", "param_importances", "search_page", "study_from_results", "write_search_page"]

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}.sub{color:#666}section{margin:1.4em 0}
table{border-collapse:collapse;font-size:12px}th,td{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f3f3f3}tr.front td{background:#fff3f0}tr.picked td{background:#fff59d}#js-errors{color:#b00}
.plot{width:100%;max-width:900px;height:480px}
"""

JS = r"""
(function(){
  var errors = document.getElementById('js-errors');
  window.addEventListener('error', function(e){ errors.textContent += (e.message || 'error') + '\n'; });
  var data = JSON.parse(document.getElementById('search-data').textContent);
  var plot = document.getElementById('pareto-plot');
  function pick(trial){
    document.querySelectorAll('tr.picked').forEach(function(r){ r.classList.remove('picked'); });
    var row = document.getElementById('trial-' + trial);
    if (row) row.classList.add('picked');
    var x = null, y = null;
    data.traces.forEach(function(t){
      t.customdata.forEach(function(c, i){ if (c === trial) { x = t.x[i]; y = t.y[i]; } });
    });
    var shapes = x === null ? [] : [{type: 'circle', xref: 'x', yref: 'y', x0: x, x1: x, y0: y, y1: y,
      line: {color: '#f9a825', width: 14}}];
    Plotly.relayout(plot, {shapes: shapes, 'title.text': data.title + (x === null ? '' : ' (trial ' + trial + ')')});
    plot.setAttribute('data-picked', String(trial));
  }
  Plotly.newPlot(plot, data.traces, data.layout, {responsive: true, displaylogo: false}).then(function(){
    plot.on('plotly_click', function(ev){
      var trial = ev.points[0].customdata; pick(trial);
      var row = document.getElementById('trial-' + trial); if (row) row.scrollIntoView({block: 'center'});
    });
    document.querySelectorAll('a.point-link').forEach(function(a){
      a.addEventListener('click', function(ev){ ev.preventDefault(); pick(Number(a.getAttribute('data-trial')));
        plot.scrollIntoView({block: 'center'}); });
    });
    var wanted = /^#pick-(\d+)$/.exec(location.hash);  // a link to one trial's point (and the browser test)
    if (wanted) pick(Number(wanted[1]));
    var bars = document.getElementById('importance-plot');
    if (bars && data.importance_traces.length)
      return Plotly.newPlot(bars, data.importance_traces, data.importance_layout, {displaylogo: false});
  }).then(function(){ document.body.setAttribute('data-ready', '1'); });
})();
"""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _distribution(values: Sequence[Any]) -> Any:
    """The narrowest Optuna distribution holding ``values`` (ints / floats as ranges, else categories)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if all(type(v) is int for v in values):
        return IntDistribution(min(values), max(values))
    if all(_number(v) is not None for v in values):
        return FloatDistribution(float(min(values)), float(max(values)))
    return CategoricalDistribution(sorted({v for v in values}, key=repr))


def study_from_results(doc: Mapping[str, Any]) -> optuna.Study:
    """An in-memory study of the results JSON's complete trials (every objective a finite number)."""
    import optuna

    objectives, directions = list(doc.get("objectives", [])), list(doc.get("directions", []))
    rows = [r for r in doc.get("trials", []) if r.get("state", "COMPLETE") == "COMPLETE"
            and all(_number(r.get(o)) is not None for o in objectives)]
    seen: dict[str, list[Any]] = {}
    for r in rows:
        for k, v in r.get("params", {}).items():
            seen.setdefault(k, []).append(v)
    dists = {k: _distribution(v) for k, v in seen.items()}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" line for an in-memory copy
    try:
        study = optuna.create_study(directions=directions or ["maximize"] * max(len(objectives), 1))
    finally:
        optuna.logging.set_verbosity(verbosity)
    for r in rows:
        params = dict(r.get("params", {}))
        study.add_trial(optuna.trial.create_trial(params=params, distributions={k: dists[k] for k in params},
                                                  values=[float(r[o]) for o in objectives]))
    return study


def _value(trial: optuna.trial.FrozenTrial, index: int) -> float:
    """The trial's ``index``-th objective value (an importance's target)."""
    return float(trial.values[index])


def param_importances(study: optuna.Study, objectives: Sequence[str]) -> tuple[dict[str, dict[str, float]], str]:
    """Objective -> {param: importance} (fANOVA, seed 0), and a note when they could not be computed."""
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(done) < 2 or not any(t.params for t in done):
        return {}, f"Parameter importances need at least two complete trials with parameters ({len(done)} here)."
    out: dict[str, dict[str, float]] = {}
    for i, name in enumerate(objectives):
        try:
            found = get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0),
                                          target=functools.partial(_value, index=i))
            out[name] = {k: float(v) for k, v in found.items()}
        except (RuntimeError, ValueError) as exc:  # e.g. every trial with the same parameters
            return out, f"Parameter importances not computed for {name}: {exc}"
    return out, ""


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as None (strict JSON for the page)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _json_script(value: Any) -> str:
    text = json.dumps(value, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f'<script type="application/json" id="search-data">{text}</script>'


def _traces(doc: Mapping[str, Any], front: set[int]) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    objectives = list(doc.get("objectives", []))
    rows = [r for r in doc.get("trials", []) if all(_number(r.get(o)) is not None for o in objectives)]
    if len(objectives) >= 2:
        x, y = objectives[1], objectives[0]
        title = f"Pareto front: {y} vs {x}"
    else:
        x, y = "trial", objectives[0] if objectives else "value"
        title = f"{y} per trial"
    traces = []
    for label, keep, colour in (("trials", False, "#9e9e9e"), ("Pareto front", True, "#d32f2f")):
        pts = sorted((r for r in rows if (r["trial"] in front) == keep), key=lambda r: (r.get(x, r["trial"]),))
        traces.append({"type": "scatter", "mode": "lines+markers" if keep and x != "trial" else "markers",
                       "name": label, "x": [r[x] if x != "trial" else r["trial"] for r in pts],
                       "y": [r[y] for r in pts], "customdata": [r["trial"] for r in pts],
                       "text": [f"trial {r['trial']}" for r in pts], "marker": {"color": colour, "size": 9},
                       "hovertemplate": "%{text}<br>" + "x=%{x}<br>y=%{y}<extra></extra>"})
    base = doc.get("baseline") or {}
    if _number(base.get(x)) is not None and _number(base.get(y)) is not None:
        traces.append({"type": "scatter", "mode": "markers", "name": "baseline", "x": [base[x]], "y": [base[y]],
                       "customdata": [-1], "marker": {"symbol": "star", "size": 15, "color": "#1565c0"}})
    layout = {"title": {"text": title}, "xaxis": {"title": {"text": x}}, "yaxis": {"title": {"text": y}},
              "hovermode": "closest", "margin": {"t": 50}}
    return traces, layout, title


def _table(doc: Mapping[str, Any], front: set[int]) -> str:
    objectives = list(doc.get("objectives", []))
    names = sorted({k for r in doc.get("trials", []) for k in r.get("params", {})})
    head = "".join(f"<th>{escape(h)}</th>" for h in ["trial", "state", *objectives, "feasible", *names])
    rows = []
    for r in doc.get("trials", []):
        n = int(r["trial"])
        link = (f"<a href='#pareto' class='point-link' data-trial='{n}'>{n}</a>"
                if all(_number(r.get(o)) is not None for o in objectives) else str(n))
        cells = [link, escape(str(r.get("state", ""))), *(escape(_fmt(r.get(o))) for o in objectives),
                 escape(str(r.get("feasible", ""))), *(escape(_fmt(r.get("params", {}).get(p))) for p in names)]
        cls = "trial-row front" if n in front else "trial-row"
        rows.append(f"<tr id='trial-{n}' class='{cls}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<table id='trials'><thead><tr>{head}</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _importance_section(imp: Mapping[str, Mapping[str, float]], note: str) -> tuple[str, list[Any], dict[str, Any]]:
    if not imp:
        return f"<p id='importance-note'>{escape(note)}</p>", [], {}
    params = sorted({p for v in imp.values() for p in v})
    head = "".join(f"<th>{escape(o)}</th>" for o in imp)
    rows = "".join(f"<tr class='importance-row' data-param='{escape(p)}'><td>{escape(p)}</td>"
                   + "".join(f"<td>{imp[o].get(p, 0.0):.3f}</td>" for o in imp) + "</tr>" for p in params)
    traces = [{"type": "bar", "orientation": "h", "name": o, "y": list(v), "x": list(v.values())}
              for o, v in imp.items()]
    layout = {"title": {"text": "Parameter importances (fANOVA)"}, "barmode": "group", "margin": {"l": 160},
              "xaxis": {"title": {"text": "importance"}}}
    html = (f"<div id='importance-plot' class='plot'></div><table id='importances'><thead><tr><th>parameter</th>"
            f"{head}</tr></thead><tbody>{rows}</tbody></table>")
    if note:
        html += f"<p class='sub'>{escape(note)}</p>"
    return html, traces, layout


def _document(source: SearchResult | Mapping[str, Any]) -> tuple[dict[str, Any], optuna.Study]:
    if isinstance(source, SearchResult):
        doc = {"study": source.study.study_name, "objectives": source.objectives, "directions": source.directions,
               "baseline": source.baseline, "front": source.rows(), "trials": source.rows(source.study.trials)}
        return _finite(json.loads(json.dumps(doc, default=str))), source.study
    doc = check_search_results(source)
    return doc, study_from_results(doc)


def search_page(source: SearchResult | Mapping[str, Any], title: str = "fxforge search") -> str:
    """The search page of a SearchResult or of a results JSON document, as one offline HTML document."""
    from plotly.offline import get_plotlyjs

    doc, study = _document(source)
    objectives = [str(o) for o in doc.get("objectives", [])]
    front = {int(r["trial"]) for r in doc.get("front", [])}
    traces, layout, plot_title = _traces(doc, front)
    imp, note = param_importances(study, objectives)
    imp_html, imp_traces, imp_layout = _importance_section(imp, note)
    data = {"title": plot_title, "traces": traces, "layout": layout, "importance_traces": imp_traces,
            "importance_layout": imp_layout}
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1><p class='sub'>Study <b>{escape(str(doc.get('study', '')))}</b>: "
        f"{len(doc.get('trials', []))} trials, {len(front)} on the front; objectives "
        f"{escape(', '.join(f'{o} ({d})' for o, d in zip(objectives, doc.get('directions', []))))}.</p>",
        '<pre id="js-errors"></pre>', _json_script(data),
        f"<script>{get_plotlyjs()}</script>",
        "<section id='pareto'><h2>Pareto front</h2><div id='pareto-plot' class='plot'></div><p class='sub'>Click a "
        "point to find its trial; click a trial number to find its point.</p></section>",
        "<section><h2>Trials</h2>" + _table(doc, front) + "</section>",
        "<section><h2>Parameter importances</h2>" + imp_html + "</section>",
        f"<script>{JS}</script></body></html>",
    ]) + "\n"


def write_search_page(source: SearchResult | Mapping[str, Any], path: str | Path,
                      title: str = "fxforge search") -> Path:
    """Write :func:`search_page` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(search_page(source, title), encoding="utf-8")
    return path
