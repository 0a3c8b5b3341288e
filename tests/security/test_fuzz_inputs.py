"""Property (issue 26): every file a user hands fxforge besides checkpoints -- LoRA adapters, pipeline and search
TOML, search results JSON -- mutated with type-confused values, deep nesting and long escape runs, loads or is
refused with fxforge's own error, never another exception, and within a time budget per input (hypothesis'
deadline: generous for a loaded 2-core machine, far below what a quadratic or exponential parser would take on
these sizes). A loaded adapter never changes a base weight it does not own. ``FXFORGE_FUZZ_EXAMPLES=2000`` runs
a bigger campaign by hand."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_helpers import mutate_json, remanifest, tiny_graph

from fxforge import ForgeGraph, passes
from fxforge.passes.lora_checkpoint import CONFIG, LoraCheckpointError, load_lora_adapters, save_lora_adapters
from fxforge.pipelines import Pipeline, PipelineError
from fxforge.report import html as report_html
from fxforge.report.search_json import SearchResultsError, load_search_results
from fxforge.search import SearchError, load_config, search_from_config
from fxforge.search import config as search_config

EXAMPLES = int(os.environ.get("FXFORGE_FUZZ_EXAMPLES", "0")) or None
BUDGET = timedelta(seconds=6)  # per input; the attacks of issue 26 took 18 s to hours at these sizes
FUZZ = settings(deadline=BUDGET, suppress_health_check=list(HealthCheck), database=None)

NAMES = ["fc", "out", "fc.base.weight", "out.weight", "wte.weight", "", "..", "/etc/passwd", "$\\frac{$", "export",
         "$" + "\\sqrt{" * 12 + "x" + "}" * 12 + "$",
         "quantize_transform_pass", "accuracy", "avg_weight_bits", "precision", "nas", "pruning", "lora", "joint",
         "tiny-bert", "__class__", "steps", "formats", "integer", "width"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.sampled_from(NAMES),
                    st.text(max_size=10))
VALUES = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=5),
                                                                      kids, max_size=3)), max_leaves=8)
SIZES = st.one_of(st.sampled_from([3_000, 12_000, 40_000]), st.integers(30, 40_000))  # big sizes often
RAN: dict[str, list[int]] = {}  # per target: [accepted, refused]


def _count(target: str, accepted: bool) -> None:
    RAN.setdefault(target, [0, 0])[0 if accepted else 1] += 1


def _hostile_text(data: st.DataObject, syntax: str) -> str:
    """A fragment that stresses a parser: brackets nested thousands deep, a long run of escaped quotes
    (terminated or not), a dotted key of thousands of parts, or thousands of ``$`` math groups. For TOML a
    whole statement (its own line), so the parser reaches it instead of stopping at a syntax error."""
    n = data.draw(SIZES)
    kind = data.draw(st.sampled_from(["arrays", "tables", "escapes", "open-escapes", "dotted", "math"]))
    if syntax == "toml":
        value = {"arrays": "[" * n + "]" * n, "tables": "{a = " * n + "1" + "}" * n,
                 "escapes": '"' + '\\"' * n + '"', "open-escapes": '"' + '\\"' * n, "dotted": "1",
                 "math": json.dumps("$\\sqrt{" * (n // 10) + "x" + "}$" * (n // 10))}[kind]
        key = "k" + ".k" * n if kind == "dotted" else "k"
        return f"\n{key} = {value}\n"
    if kind == "arrays":
        return "[" * n + "]" * n
    if kind == "tables":
        return '{"a":' * n + "1" + "}" * n
    if kind in ("escapes", "open-escapes"):
        return '"' + '\\"' * n + ('"' if kind == "escapes" else "")
    if kind == "dotted":
        return '"' + ".a" * n + '"'
    return json.dumps("$\\sqrt{" * (n // 10) + "x" + "}$" * (n // 10))


def _mutate(doc: Any, data: st.DataObject) -> Any:
    """Replace, delete or insert one value anywhere in ``doc`` (type confusion: any JSON value anywhere)."""
    return mutate_json(doc, data, VALUES, st.sampled_from(NAMES))


def _inject(text: str, data: st.DataObject, syntax: str) -> str:
    """Splice a hostile fragment into the text: at the start of a line (TOML: a statement the parser
    reaches) or anywhere."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    at = data.draw(st.sampled_from(starts) if syntax == "toml" and data.draw(st.booleans())
                   else st.integers(0, len(text)))
    return text[:at] + _hostile_text(data, syntax) + text[at:]


def _document(base: Any, data: st.DataObject, syntax: str) -> tuple[Any, bool]:
    """(a mutated copy of ``base``, whether to splice raw hostile text into its serialisation too)."""
    doc = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(0, 3))):
        doc = _mutate(doc, data)
    return doc, data.draw(st.booleans())


# -- TOML serialisation of the generated documents (no writer in the standard library) -----------------------
def _toml_value(v: Any) -> str:
    if v is None:
        return '"null"'  # TOML has no null
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml(doc: Any) -> str:
    if not isinstance(doc, dict):
        return f"value = {_toml_value(doc)}\n"
    return "".join(f"{json.dumps(str(k))} = {_toml_value(v)}\n" for k, v in doc.items())


# -- LoRA adapters ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora() -> tuple[ForgeGraph, Path]:
    base = tiny_graph("fx")
    mg, _ = passes.insert_lora_adapter_transform_pass(base.copy(), {"rank": 2, "targets": {"name": ["fc"]},
                                                                    "trainable": {"name": ["out"]}})
    return base, save_lora_adapters(mg, Path(tempfile.mkdtemp(prefix="fuzz_lora")) / "adapters")


@settings(FUZZ, max_examples=EXAMPLES or 120)
@given(data=st.data())
def test_mutated_adapters_load_or_fail_cleanly(lora: tuple[ForgeGraph, Path], data: st.DataObject) -> None:
    base, pristine = lora
    name = data.draw(st.sampled_from([CONFIG, CONFIG, "manifest.json"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(shutil.copytree(pristine, Path(tmp) / "adapters"))
        doc, splice = _document(json.loads((path / name).read_text()), data, "json")
        text = json.dumps(doc)
        (path / name).write_text(_inject(text, data, "json") if splice else text)
        if name == CONFIG:
            remanifest(path)
        try:
            loaded, info = load_lora_adapters(base, path)
        except LoraCheckpointError:
            return _count("adapters", False)
    _count("adapters", True)
    owned = set(info["extras"])
    for pname, p in base.model.named_parameters():  # the adapted layer's frozen weight now lives at fc.base.*
        mapped = pname.replace("fc.", "fc.base.", 1) if pname.startswith("fc.") else pname
        if mapped not in owned:
            assert torch.equal(loaded.model.get_parameter(mapped), p), f"the adapter replaced base weight {pname}"


# -- pipeline and search TOML ---------------------------------------------------------------------------------
PIPELINE = {"name": "fuzz", "verify": True, "steps": [
    {"pass": "remove_dropout_transform_pass"},
    {"pass": "quantize_transform_pass", "contract": {"min_sqnr_db": 10.0},
     "args": {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 8, "data_in_width": 8}}}},
    {"pass": "export", "args": {"path": "out.ckpt"}}]}
SEARCH = {"search": {"study_name": "fuzz", "n_trials": 2, "sampler": "random", "objectives": ["accuracy"]},
          "model": {"name": "tiny-bert"}, "task": {"train_size": 8, "eval_size": 8},
          "space": {"kind": "precision", "formats": {"integer": {"width": [4, 8], "frac_width": [2, 3]}}},
          "constraints": [{"objective": "accuracy", "max_drop": 0.1}]}


@settings(FUZZ, max_examples=EXAMPLES or 200)
@given(data=st.data())
def test_mutated_pipeline_toml_builds_or_fails_cleanly(data: st.DataObject) -> None:
    doc, splice = _document(PIPELINE, data, "toml")
    text = _toml(doc)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.toml"
        path.write_text(_inject(text, data, "toml") if splice else text, encoding="utf-8", errors="surrogatepass")
        try:
            Pipeline.from_toml(path)
            _count("pipeline TOML", True)
        except PipelineError:
            _count("pipeline TOML", False)
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["pipeline.toml"]  # building writes nothing


class _Task:
    """Stands in for TextClassificationTask (which downloads a dataset): the fuzz checks the config, not data."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@settings(FUZZ, max_examples=EXAMPLES or 150)
@given(data=st.data())
def test_mutated_search_toml_builds_or_fails_cleanly(data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, splice = _document(SEARCH, data, "toml")
    text = _toml(doc)
    graph = tiny_graph("fx")
    with tempfile.TemporaryDirectory() as tmp, monkeypatch.context() as m:
        m.setattr(search_config, "TextClassificationTask", _Task)
        m.setattr(search_config, "_base_graph", lambda model: graph)
        m.setattr(search_config, "check_resumable", lambda config, section: search_config._identity(config))
        path = Path(tmp) / "search.toml"
        path.write_text(_inject(text, data, "toml") if splice else text, encoding="utf-8", errors="surrogatepass")
        try:
            search_from_config(load_config(path))
            _count("search TOML", True)
        except SearchError:
            _count("search TOML", False)


# -- search results JSON --------------------------------------------------------------------------------------
RESULTS = {"study": "s", "objectives": ["accuracy", "avg_weight_bits"], "directions": ["maximize", "minimize"],
           "baseline": {"accuracy": 0.9, "avg_weight_bits": 32.0},
           "front": [{"trial": 1, "state": "COMPLETE", "accuracy": 0.8, "avg_weight_bits": 8.0, "feasible": True,
                      "cached": False, "params": {"w": 8}}],
           "trials": [{"trial": i, "state": "COMPLETE", "accuracy": 0.7 + 0.01 * i, "avg_weight_bits": 4.0 + i,
                       "feasible": True, "cached": False, "params": {"w": 4}} for i in range(3)]}


@settings(FUZZ, max_examples=EXAMPLES or 80)
@given(data=st.data())
def test_mutated_search_results_render_or_fail_cleanly(data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, splice = _document(RESULTS, data, "json")
    text = json.dumps(doc)
    plots = data.draw(st.integers(0, 4)) == 0  # matplotlib costs ~0.3 s a plot: a fifth of the inputs draw them
    with tempfile.TemporaryDirectory() as tmp, monkeypatch.context() as m:
        path = Path(tmp) / "results.json"
        path.write_text(_inject(text, data, "json") if splice else text)
        try:
            results = load_search_results(path)
        except SearchResultsError:
            return _count("search results", False)
        _count("search results", True)
        m.setattr(report_html, "plots_available", lambda: plots)
        assert "search-front" in report_html._search(results)


def teardown_module() -> None:
    print("\nfuzz (accepted, refused): " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in RAN.items()))
