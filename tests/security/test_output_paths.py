"""Paths a pipeline or search file names stay under the output root the caller gives (issue 26, item 5): an
``export`` step of ``../../../escaped/ckpt`` or ``/abs/ckpt`` (which would create the parents and replace an
fxforge checkpoint there), a report file, a search run_dir or journal/SQLite storage outside it are refused
naming the file and field, unless the caller opts in (``allow_outside_root=True`` / ``--allow-outside-root``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from security_helpers import tiny_graph

from fxforge.pipelines import Pipeline, PipelineError
from fxforge.search import SearchError, search_from_config

SPACE = {"kind": "precision", "formats": {"integer": {"width": [4, 8], "frac_width": ["auto"]}}}


def _pipeline(tmp_path: Path, step: str) -> Path:
    path = tmp_path / "pipe.toml"
    path.write_text(f'name = "p"\nverify = false\n[[steps]]\n{step}\n')
    return path


@pytest.mark.parametrize("target", ["../../../escaped/ckpt", "/tmp/fxforge-escaped/ckpt", "a/../../b", "", "."])
def test_export_outside_the_root_is_refused(tmp_path: Path, target: str) -> None:
    pipe = _pipeline(tmp_path, f'pass = "export"\nargs = {{ path = "{target}" }}')
    with pytest.raises(PipelineError, match=r"pipe\.toml: step 1 \(export\): path = .* output root"):
        Pipeline.from_toml(pipe, output_root=tmp_path / "root")
    assert not (tmp_path.parent / "escaped").exists() and not Path("/tmp/fxforge-escaped").exists()


def test_export_resolves_under_the_root_and_the_caller_can_opt_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    pipe = _pipeline(tmp_path, 'pass = "export"\nargs = { path = "sub/ckpt" }')
    graph, _ = Pipeline.from_toml(pipe, output_root=root)(tiny_graph("fx"))
    assert (root / "sub" / "ckpt" / "manifest.json").is_file()
    outside = tmp_path / "elsewhere" / "ckpt"
    pipe = _pipeline(tmp_path, f'pass = "export"\nargs = {{ path = "{outside}" }}')
    Pipeline.from_toml(pipe, output_root=root, allow_outside_root=True)(tiny_graph("fx"))
    assert (outside / "manifest.json").is_file()


def test_a_symlink_inside_the_root_does_not_lead_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "victim").mkdir()
    (root / "link").symlink_to(tmp_path / "victim")
    pipe = _pipeline(tmp_path, 'pass = "export"\nargs = { path = "link/ckpt" }')
    with pytest.raises(PipelineError, match=r"symbolic link"):
        Pipeline.from_toml(pipe, output_root=root)


@pytest.mark.parametrize("key", ["file", "file_name"])
def test_report_file_of_a_pass_is_confined_too(tmp_path: Path, key: str) -> None:
    pipe = _pipeline(tmp_path, f'pass = "report_graph_analysis_pass"\nargs = {{ {key} = "../table.txt" }}')
    with pytest.raises(PipelineError, match=rf"step 1 .*{key} = '../table.txt' .*output root"):
        Pipeline.from_toml(pipe, output_root=tmp_path / "root")


@pytest.mark.parametrize(("key", "value"), [("run_dir", "../runs"), ("run_dir", "/tmp/fxforge-runs"),
                                            ("storage", "../study.journal"), ("storage", "sqlite:////tmp/x.db"),
                                            ("storage", "sqlite:///../x.db")])
def test_search_paths_outside_the_root_are_refused(tmp_path: Path, key: str, value: str) -> None:
    config = {"search": {key: value}, "model": {"name": "tiny-bert"}, "space": SPACE}
    with pytest.raises(SearchError, match=rf"\[search\] {key} = .*output root"):
        search_from_config(config, output_root=tmp_path)


def test_search_paths_resolve_under_the_root(tmp_path: Path) -> None:
    # size only: an accuracy objective needs evaluation data, which search_from_config now asks for up front
    config = {"search": {"run_dir": "runs", "storage": "sqlite:///study.db", "resume": False,
                         "objectives": ["avg_weight_bits"]}, "model": {"name": "tiny-bert"}, "space": SPACE}
    search = search_from_config(config, output_root=tmp_path)
    assert Path(search.run_dir) == tmp_path / "runs" and search.storage == f"sqlite:///{tmp_path / 'study.db'}"
    outside = search_from_config({**config, "search": {"run_dir": str(tmp_path.parent / "r"), "resume": False,
                                                       "objectives": ["avg_weight_bits"]}},
                                 output_root=tmp_path, allow_outside_root=True)
    assert Path(outside.run_dir) == tmp_path.parent / "r"


def test_cli_run_refuses_an_escaping_export_unless_allowed(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
    from cli_support import run_cli

    work = tmp_path / "work"
    work.mkdir()
    pipe = _pipeline(tmp_path, 'pass = "export"\nargs = { path = "../escaped/ckpt" }')
    proc = run_cli("run", str(pipe), "tiny-bert", "-o", str(work / "out"), cwd=work)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and f"{pipe}: step 1 (export): path" in lines[0], proc.stderr
    assert not (tmp_path / "escaped").exists()
    proc = run_cli("run", str(pipe), "tiny-bert", "-o", str(work / "out"), "--allow-outside-root", cwd=work)
    assert proc.returncode == 0, proc.stderr[-800:]
    assert (tmp_path / "escaped" / "ckpt" / "manifest.json").is_file()
