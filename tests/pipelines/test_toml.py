"""Pipelines from TOML files: the same document as from_dict; syntax errors name the line; hostile input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toys import CALLS, small_graph, toy_passes  # noqa: F401 (fixture)

from fxforge.pipelines import ContractViolation, Pipeline, PipelineError

pytestmark = pytest.mark.usefixtures("toy_passes")

GOOD = """\
name = "toml-demo"
verify = true

[[steps]]
pass = "_mark_pass"

[[steps]]
pass = "_bounded_scale_pass"
contract = { min_sqnr_db = 10.0 }
[steps.args]
factor = 1.01

[[steps]]
pass = "_needs_mark_pass"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipe.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_from_toml_builds_and_runs(tmp_path: Path) -> None:
    pipe = Pipeline.from_toml(_write(tmp_path, GOOD))
    assert pipe.name == "toml-demo" and [s.name for s in pipe.steps] == ["_mark_pass", "_bounded_scale_pass",
                                                                         "_needs_mark_pass"]
    assert pipe.steps[1].built.factor == 1.01 and pipe.steps[1].contract.min_sqnr_db == 10.0
    mg, report = pipe(small_graph())
    assert report[1].contract.kind == "bounded" and report[1].contract.ok
    assert torch.allclose(mg.model.get_submodule("0").weight, small_graph().model.get_submodule("0").weight * 1.01)
    strict = Pipeline.from_toml(_write(tmp_path, GOOD.replace("min_sqnr_db = 10.0", "min_sqnr_db = 80.0")))
    with pytest.raises(ContractViolation, match=r"step 2 \(_bounded_scale_pass\) bounded contract: SQNR"):
        strict(small_graph())


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    bad = GOOD.replace('pass = "_bounded_scale_pass"', 'pass = "_bounded_scale_pass')  # line 8: unclosed string
    path = _write(tmp_path, bad)
    with pytest.raises(PipelineError, match=r"pipe\.toml: TOML syntax error at line 8"):
        Pipeline.from_toml(path)


def test_toml_bad_content_is_refused_with_the_file_and_step(tmp_path: Path) -> None:
    calls = CALLS
    cases = {
        GOOD.replace("factor = 1.01", "factr = 1.01"): r"step 2 \(_bounded_scale_pass\): invalid args.*'factr'",
        GOOD.replace('pass = "_needs_mark_pass"', 'pass = "_needs_mark"'): r"step 3: unknown pass '_needs_mark'; "
                                                                           r"did you mean '_needs_mark_pass'",
        GOOD.replace("verify = true", "verify = true\nsteps_extra = 1"): r"unknown pipeline key\(s\) \['steps_extra'\]",
        GOOD.replace("factor = 1.01", 'factor = "big"'): r"step 2 .*does not match the expected type",
        GOOD.replace("min_sqnr_db = 10.0", "sqnr = 10.0"): r"step 2 .*unknown contract threshold",
        'name = "x"\nsteps = 3\n': r"needs 'steps', a list",
        'name = "x"\nsteps = [1]\n': r"step 1: expected a table",
    }
    for text, message in cases.items():
        with pytest.raises(PipelineError, match=message):
            Pipeline.from_toml(_write(tmp_path, text))
    assert calls == []
    with pytest.raises(PipelineError, match=r"missing\.toml: no such pipeline file"):
        Pipeline.from_toml(tmp_path / "missing.toml")
    (tmp_path / "bin.toml").write_bytes(b"name = \"\xff\"\n")
    with pytest.raises(PipelineError, match=r"bin\.toml: pipeline file is not UTF-8 text \(invalid start byte at"):
        Pipeline.from_toml(tmp_path / "bin.toml")


def test_hostile_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    """The one TOML reader (graph/toml_file.py): a file over the size cap is refused before it is read, as are a
    directory and a FIFO (which would block a plain read); a file at the cap parses."""
    import os

    from fxforge.graph.toml_file import MAX_TOML_BYTES, TomlFileError, load_toml_file

    big = tmp_path / "big.toml"
    big.write_text(GOOD + "#" * (MAX_TOML_BYTES - len(GOOD)) + "\n")
    with pytest.raises(PipelineError, match=rf"big\.toml: {MAX_TOML_BYTES + 1} bytes is larger than the "
                                            rf"{MAX_TOML_BYTES} allowed for a pipeline file"):
        Pipeline.from_toml(big)
    big.write_text(GOOD + "#" * (MAX_TOML_BYTES - len(GOOD) - 1) + "\n")
    assert Pipeline.from_toml(big).name == "toml-demo"
    with pytest.raises(PipelineError, match=r"is a directory, not a pipeline file"):
        Pipeline.from_toml(tmp_path)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(TomlFileError, match=r"fifo\.toml: not a regular file"):
        load_toml_file(fifo)
