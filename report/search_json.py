"""Reading the search results JSON (``fxforge search --results``, SearchResult.to_json) that a report plots.

The file is hostile input like any other: read through the hardened reader (regular file, size cap, strict
UTF-8), parsed with bounded nesting (graph/atomic.loads_json), then every field's type is checked, so the
report never meets a row that is not an object or a value that is not a number or a string. An objective
name is at most ``MAX_NAME`` characters (it becomes a plot label; labels are never parsed as math).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..graph.atomic import loads_json
from ..graph.targets import CheckpointError
from ..graph.toml_file import read_user_file

__all__ = ["MAX_RESULTS_BYTES", "SearchResultsError", "check_search_results", "load_search_results"]

MAX_RESULTS_BYTES = 64 * 2**20
MAX_NAME = 100
MAX_OBJECTIVES = 16
MAX_ROWS = 100_000
_KEYS = ("study", "objectives", "directions", "baseline", "front", "trials")
_ROW_KEYS = ("trial", "state", "feasible", "cached", "params")


class SearchResultsError(ValueError):
    """Search results that cannot be shown; the message names the file and the field."""


def _number_or_text(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float)


def _fail(where: str, field: str, what: str, value: Any) -> SearchResultsError:
    return SearchResultsError(f"{where}: {field} must be {what}, got {type(value).__name__}")


def _scalars(value: Any) -> bool:
    return isinstance(value, dict) and all(x is None or isinstance(x, str | int | float | bool) for x in value.values())


_ROW_CHECKS = (("trial", lambda v: type(v) is int, "an integer"),
               ("state", lambda v: isinstance(v, str), "a string"),
               ("feasible", lambda v: isinstance(v, bool), "a bool"),
               ("cached", lambda v: isinstance(v, bool), "a bool"),
               ("params", _scalars, "an object of scalars"))


def _rows(doc: Mapping[str, Any], key: str, objectives: list[str], where: str) -> None:
    rows = doc.get(key, [])
    if not isinstance(rows, list) or len(rows) > MAX_ROWS:
        raise _fail(where, repr(key), f"a list of at most {MAX_ROWS} objects", rows)
    allowed = {*_ROW_KEYS, *objectives}
    for i, row in enumerate(rows):
        at = f"{key}[{i}]"
        if not isinstance(row, dict):
            raise _fail(where, at, "an object", row)
        unknown = sorted(str(k)[:40] for k in row if k not in allowed)
        if unknown:
            raise SearchResultsError(f"{where}: {at}: unknown key(s) {unknown[:5]}; allowed: the objectives and "
                                     f"{list(_ROW_KEYS)}")
        for field, ok, what in _ROW_CHECKS:
            if field in row and not ok(row[field]):
                raise _fail(where, f"{at}.{field}", what, row[field])
        for name in objectives:
            if not _number_or_text(row.get(name)) or isinstance(row.get(name), bool):
                raise _fail(where, f"{at}.{name}", "a number, a string or null", row[name])


def check_search_results(doc: Any, where: str = "search results") -> dict[str, Any]:
    """``doc`` checked field by field (SearchResultsError naming ``where`` and the field); returned as a dict."""
    if not isinstance(doc, Mapping):
        raise _fail(where, "the document", "a JSON object as written by `fxforge search --results`", doc)
    unknown = sorted(str(k)[:40] for k in doc if k not in _KEYS)
    if unknown:
        raise SearchResultsError(f"{where}: unknown key(s) {unknown[:5]}; allowed: {list(_KEYS)}")
    if not isinstance(doc.get("study", ""), str):
        raise _fail(where, "'study'", "a string", doc["study"])
    objectives = doc.get("objectives", [])
    if not isinstance(objectives, list) or len(objectives) > MAX_OBJECTIVES:
        raise _fail(where, "'objectives'", f"a list of at most {MAX_OBJECTIVES} names", objectives)
    for i, name in enumerate(objectives):
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise _fail(where, f"objectives[{i}]", f"a name of 1 to {MAX_NAME} characters", name)
    directions = doc.get("directions", [])
    if not isinstance(directions, list) or any(d not in ("maximize", "minimize") for d in directions):
        raise SearchResultsError(f"{where}: 'directions' must be a list of 'maximize' / 'minimize'")
    baseline = doc.get("baseline") or {}
    if not isinstance(baseline, dict) or not all(_number_or_text(v) for v in baseline.values()):
        raise _fail(where, "'baseline'", "an object of numbers", baseline)
    for key in ("front", "trials"):
        _rows(doc, key, objectives, where)
    return dict(doc)


def load_search_results(path: str | Path) -> dict[str, Any]:
    """Read, parse and check a search results JSON file; SearchResultsError naming the file (and field)."""
    text = read_user_file(path, "search results file", SearchResultsError, MAX_RESULTS_BYTES)
    try:
        doc = loads_json(text.encode(), str(path), MAX_RESULTS_BYTES)
    except CheckpointError as exc:
        raise SearchResultsError(str(exc)) from None
    return check_search_results(doc, str(path))
