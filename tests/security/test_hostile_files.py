"""Hostile files a user hands fxforge (issue 26, item 7): checkpoints with wrongly typed history/metadata, search
results JSON, pipeline and search TOML nested thousands deep or wrongly typed. Each is refused with fxforge's
own error naming the file and field, never a raw AttributeError / TypeError / RecursionError."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from security_helpers import edit_json, fresh_copy, tiny_graph

from fxforge import CheckpointError, ForgeGraph, passes
from fxforge.graph.toml_file import TomlFileError, parse_toml_text
from fxforge.pipelines import Pipeline, PipelineError
from fxforge.report import write_report
from fxforge.report.search_json import SearchResultsError, check_search_results, load_search_results
from fxforge.search import SearchError, load_config, search_from_config

SPACE = {"kind": "precision", "formats": {"integer": {"width": [4, 8], "frac_width": [2, 3]}}}
DEEP = {
    "arrays": "a = " + "[" * 3000 + "]" * 3000,
    "inline tables": "a = " + "{b = " * 3000 + "1" + "}" * 3000,
    "dotted key": "a" + ".a" * 3000 + " = 1",
    "dotted table": "[" + ".".join(["a"] * 3000) + "]",
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mg, _ = passes.init_metadata_analysis_pass(tiny_graph("fx"))
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg.export(tmp_path_factory.mktemp("report") / "ckpt")


# -- checkpoints: every loaded field has its type -----------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("name", 5), ("name", ["a"]), ("kind", {"a": 1}), ("args", [1])])
def test_history_fields_are_typed_on_load(ckpt: Path, tmp_path: Path, field: str, value: Any) -> None:
    path = fresh_copy(ckpt, tmp_path)
    edit_json(path, "graph.json", lambda doc: doc["history"][0].__setitem__(field, value))
    with pytest.raises(CheckpointError, match=rf"graph\.json: .*history record .*: {field} must be"):
        ForgeGraph.from_checkpoint(path)


@pytest.mark.parametrize(("field", "value"), [("dtype", 5), ("type", None), ("precision", "ab"), ("value", [1]),
                                              ("requires_grad", "yes"), ("shape", [1.5])])
def test_metadata_value_fields_are_typed_on_load(ckpt: Path, tmp_path: Path, field: str, value: Any) -> None:
    path = fresh_copy(ckpt, tmp_path)
    edit_json(path, "metadata.json", lambda doc: doc["nodes"]["x"]["common"]["results"]["data_out_0"].__setitem__(
        field, value))
    with pytest.raises(CheckpointError, match=rf"metadata\.json: node 'x'.*data_out_0\.{field}"):
        ForgeGraph.from_checkpoint(path)


def test_metadata_op_is_typed_on_load(ckpt: Path, tmp_path: Path) -> None:
    path = fresh_copy(ckpt, tmp_path)
    edit_json(path, "metadata.json", lambda doc: doc["nodes"]["x"]["common"].__setitem__("op", 5))
    with pytest.raises(CheckpointError, match=r"node 'x'.*common\.op must be a string"):
        ForgeGraph.from_checkpoint(path)


# -- search results JSON --------------------------------------------------------------------------------
RESULTS: dict[str, Any] = {
    "study": "s", "objectives": ["accuracy", "avg_weight_bits"], "directions": ["maximize", "minimize"],
    "baseline": {"accuracy": 0.9, "avg_weight_bits": 32.0},
    "front": [{"trial": 1, "state": "COMPLETE", "accuracy": 0.8, "avg_weight_bits": 8.0, "feasible": True,
               "cached": False, "params": {"w": 8}}],
    "trials": [{"trial": i, "state": "COMPLETE", "accuracy": 0.7 + 0.01 * i, "avg_weight_bits": 4.0 + i,
                "feasible": True, "cached": False, "params": {"w": 4}} for i in range(3)]}


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.__setitem__("front", [1, "x"]), r"front\[0\]"),
    (lambda d: d.__setitem__("front", {"a": 1}), r"'front'"),
    (lambda d: d.__setitem__("objectives", [{"a": 1}]), r"objectives\[0\]"),
    (lambda d: d.__setitem__("objectives", ["$\\sqrt{" * 400 + "x" + "}$" * 400]), r"objectives\[0\]"),
    (lambda d: d["trials"][1].__setitem__("params", [1]), r"trials\[1\]\.params"),
    (lambda d: d["front"][0].__setitem__("accuracy", {"a": 1}), r"front\[0\]\.accuracy"),
    (lambda d: d.__setitem__("baseline", [1]), r"'baseline'"),
    (lambda d: d.__setitem__("study", 5), r"'study'"),
])
def test_malformed_search_results_are_refused_naming_the_field(tmp_path: Path, edit: Any, field: str) -> None:
    doc = json.loads(json.dumps(RESULTS))
    edit(doc)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SearchResultsError, match=rf"results\.json: {field}"):
        load_search_results(path)
    with pytest.raises(SearchResultsError, match=field):
        check_search_results(doc)


def test_search_results_files_are_bounded(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SearchResultsError, match=r"deep\.json: .*nested"):
        load_search_results(deep)
    with pytest.raises(SearchResultsError, match=r"is a directory"):
        load_search_results(tmp_path)
    (tmp_path / "latin.json").write_bytes(b'{"study": "caf\xe9"}')
    with pytest.raises(SearchResultsError, match=r"latin\.json: .*UTF-8"):
        load_search_results(tmp_path / "latin.json")


def test_objective_names_are_never_parsed_as_math(ckpt: Path, tmp_path: Path) -> None:
    """A name with unbalanced or nested ``$`` is drawn as the text it is (matplotlib's mathtext is off)."""
    doc = json.loads(json.dumps(RESULTS).replace("avg_weight_bits", "$\\\\frac{$bits"))
    check_search_results(doc)
    html = write_report(ForgeGraph.from_checkpoint(ckpt), tmp_path / "r.html", search_results=doc).read_text()
    assert html.count('<img class="plot"') == 1 and "$\\frac{$bits" in html


def test_write_report_validates_results_given_from_python(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(SearchResultsError, match=r"front\[0\] must be an object"):
        write_report(ForgeGraph.from_checkpoint(ckpt), tmp_path / "r.html", search_results={**RESULTS, "front": [1]})


# -- TOML: nesting bounded before the parser recurses (or goes quadratic) -------------------------------------
@pytest.mark.parametrize("kind", sorted(DEEP))
def test_deep_toml_is_refused_quickly(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(DEEP[kind])
    start = time.perf_counter()
    with pytest.raises(SearchError, match=r"deep\.toml: .*nested"):
        load_config(path)
    with pytest.raises(PipelineError, match=r"deep\.toml: .*nested"):
        Pipeline.from_toml(path)
    assert time.perf_counter() - start < 5.0  # linear: tomllib is quadratic on a 3,000-part dotted key


@pytest.mark.parametrize("text", ['a = "[[[[{{{{"', "a = '[[[[.....'", 'a = """\n[[[[\n"""', "# [[[[[[[[[\nb = 1",
                                  "a = 'x' # " + "[" * 100, "x = 1.5\ny = [[1, 2], [3.25, 4]]", 'a."b.c".d = 1',
                                  'a = "\\"[[[["'])
def test_brackets_and_dots_in_strings_and_comments_do_not_count(text: str) -> None:
    assert isinstance(parse_toml_text(text), dict)


def test_nesting_just_inside_the_limit_parses() -> None:
    assert parse_toml_text("a = " + "[" * 30 + "]" * 30)["a"]
    with pytest.raises(TomlFileError, match="nested"):
        parse_toml_text("a = " + "[" * 40 + "]" * 40)


# -- search configs: every section typed before anything is built --------------------------------------------
@pytest.mark.parametrize(("config", "field"), [
    ({"search": 5}, r"\[search\] must be a table"),
    ({"constraints": [1]}, r"\[\[constraints\]\] entry 1 must be a table"),
    ({"constraints": {"objective": "accuracy"}}, r"constraints must be an array of tables"),
    ({"model": [1]}, r"\[model\] must be a table"),
    ({"task": 5}, r"\[task\] must be a table"),
    ({"task": {"bogus": 1}}, r"\[task\]: unknown key\(s\) \['bogus'\]"),
    ({"task": {"train_size": "8"}}, r"\[task\] train_size must be an integer"),
    ({"search": {"n_trials": "x"}}, r"\[search\] n_trials must be an integer"),
    ({"search": {"objectives": 5}}, r"\[search\] objectives must be a list of strings"),
    ({"model": {"hf_input_names": 5}}, r"\[model\] hf_input_names must be a list of strings"),
    ({"constraints": [{"objective": 5}]}, r"\[\[constraints\]\] entry 1: objective must be a string"),
    ({"constraints": [{"objective": "accuracy", "max_drop": "x"}]}, r"entry 1: max_drop must be a number"),
])
def test_wrongly_typed_sections_are_refused(tmp_path: Path, config: dict[str, Any], field: str) -> None:
    with pytest.raises(SearchError, match=field):
        search_from_config({"space": SPACE, "model": {"name": "tiny-bert"}, **config}, run_dir=str(tmp_path))


# -- the CLI: one line naming the file and field --------------------------------------------------------------
def test_cli_names_the_file_and_field_in_one_line(ckpt: Path, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
    from cli_support import run_cli

    results = tmp_path / "results.json"
    results.write_text(json.dumps({**RESULTS, "front": [1]}))
    deep = tmp_path / "deep.toml"
    deep.write_text(DEEP["arrays"])
    typed = tmp_path / "typed.toml"
    typed.write_text('search = 5\n[space]\nkind = "precision"\n')
    for args, expected in [(("report", str(ckpt), "-o", str(tmp_path / "r.html"), "--search", str(results)),
                            f"{results}: front[0] must be an object, got int"),
                           (("search", str(deep)), f"{deep}: TOML nested more than"),
                           (("search", str(typed)), f"{typed}: [search] must be a table, got int")]:
        proc = run_cli(*args, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and expected in lines[0], (args, proc.stderr[-800:])
        assert "Error:" not in lines[0].split(expected)[0]  # no raw exception type before the message
