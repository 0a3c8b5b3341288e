"""The ``fxforge`` console script in a subprocess: outputs, exit codes and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import make_checkpoint, run_cli
from conftest import rehash_manifest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.fxforge"
    return path, make_checkpoint(path)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxforge: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_lists_every_command_and_python_m_works() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("inspect", "run", "search", "report", "verify", "draw"):
        assert command in proc.stdout
    module = subprocess.run([sys.executable, "-m", "fxforge", "verify", "--help"], capture_output=True, text=True)
    assert module.returncode == 0 and "manifest" in module.stdout


def test_inspect_zoo_model_prints_summary_within_width() -> None:
    proc = run_cli("inspect", "gpt-afno")
    assert proc.returncode == 0, proc.stderr
    assert "zoo model gpt-afno" in proc.stdout and "fft_rfft" in proc.stdout and "parameters:" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100  # COLUMNS=100
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr


def test_inspect_unknown_model_is_one_line_and_debug_shows_traceback() -> None:
    assert_one_line_error(run_cli("inspect", "resnet-9000"), "unknown model 'resnet-9000'", "minilm", "gpt-afno")
    debug = run_cli("--debug", "inspect", "resnet-9000")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_inspect_checkpoint_verify_draw_report(checkpoint: tuple[Path, int], tmp_path: Path) -> None:
    path, nodes = checkpoint
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0 and f"{nodes} nodes" in proc.stdout and "quantize_transform_pass" in proc.stdout
    proc = run_cli("verify", str(path))
    assert proc.returncode == 0, proc.stderr
    for check in ("manifest", "allowlist", "reload", "run", "outputs"):
        assert any(line.startswith(check) and " OK " in line for line in proc.stdout.splitlines()), proc.stdout
    assert proc.stdout.strip().endswith("verified")
    svg = tmp_path / "g.svg"
    assert run_cli("draw", str(path), "-o", str(svg), "--flat").returncode == 0  # grouped: test_draw_report_cmds
    assert svg.read_text().count('<g class="node"') == nodes
    html = tmp_path / "r.html"
    proc = run_cli("report", str(path), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    text = html.read_text()
    assert text.count('"kind":"node"') == nodes and text.count('<tr class="quant-row">') > 0  # every node in the view
    assert text.count('<tr class="module-row">') > 0
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained: nothing to fetch




def test_tampered_checkpoints_fail_with_one_line(checkpoint: tuple[Path, int], tmp_path: Path) -> None:
    path, _ = checkpoint
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    data = bytearray((flipped / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (flipped / "weights.safetensors").write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify", str(flipped)), "SHA-256")
    assert_one_line_error(run_cli("draw", str(flipped), "-o", str(tmp_path / "x.svg")), "SHA-256")

    evil = tmp_path / "evil"
    shutil.copytree(path, evil)
    graph = json.loads((evil / "graph.json").read_text())
    node = next(n for n in graph["nodes"] if n["op"] == "call_function")
    node["target"] = "os.system"
    (evil / "graph.json").write_text(json.dumps(graph))
    rehash_manifest(evil)
    assert_one_line_error(run_cli("verify", str(evil)), "os.system")
    assert_one_line_error(run_cli("verify", str(tmp_path / "nowhere")), "no such checkpoint")
    assert_one_line_error(run_cli("report", str(path), "-o", str(tmp_path / "r.html"), "--search",
                                  str(tmp_path / "none.json")), "no such search results")


@pytest.mark.slow  # 36 s of CLI subprocesses: make test-slow (CI); make test measured 12:21 with it
def test_run_and_search_bad_input_and_missing_features(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline\nsteps = 3\n")
    assert_one_line_error(run_cli("run", str(bad), "tiny-bert", "-o", str(tmp_path / "o")),
                          "bad.toml: TOML syntax error at line 1")
    assert_one_line_error(run_cli("run", str(tmp_path / "missing.toml"), "tiny-bert", "-o", "o"),
                          "missing.toml: no such pipeline file")
    assert_one_line_error(run_cli("search", str(bad)), "bad.toml: TOML syntax error at line 1")
    assert_one_line_error(run_cli("search", str(tmp_path)), "is a directory, not a search config")
    good = tmp_path / "good.toml"
    good.write_text('[[steps]]\npass = "remove_dropout_transform_pass"\n')
    proc = run_cli("run", str(good), "tiny-bert", "-o", str(tmp_path / "o"))
    assert proc.returncode == 0 and "remove_dropout_transform_pass" in proc.stdout, proc.stderr
    checked = run_cli("verify", str(tmp_path / "o"))
    assert checked.returncode == 0, checked.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[steps]]\npass = "remove_dropuot_transform_pass"\n')
    assert_one_line_error(run_cli("run", str(unknown), "tiny-bert", "-o", str(tmp_path / "u")),
                          "remove_dropout_transform_pass")
    assert_one_line_error(run_cli("search", "worker"), "--storage")
    usage = run_cli("run", str(good))  # missing MODEL and -o: a usage error from the CLI library
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


SEARCH_TOML = """\
[search]
study_name = "tiny"
n_trials = 2
sampler = "random"
objectives = ["accuracy", "weight_bits"]
run_dir = "{run}"
[model]
name = "tiny-bert"
[task]
train_size = 8
eval_size = 16
max_length = 16
eval_batch_size = 8
[space]
kind = "precision"
formats = {{ integer = {{ width = [4, 8], frac_width = [2, 3] }} }}
"""


def _optuna_lines_start_clean(stderr: str) -> int:
    """How many Optuna INFO records stderr holds; asserts each starts its own line (after the bar was erased
    with '\\r'), never glued after a progress-bar fragment on the bar's line."""
    records = 0
    for line in stderr.split("\n"):
        for part in line.split("\r"):
            if "[I " in part and "Trial " in part:
                assert part.startswith("[I "), f"an Optuna record inside the progress bar's line: {part!r}"
                records += 1
    return records


@pytest.mark.slow  # 28 s, two CLI searches; resuming is also tested in-process (tests/search)
def test_search_config_runs_then_a_rerun_resumes_and_adds_trials(tmp_path: Path) -> None:
    """`fxforge search CONFIG.toml` on a valid config (the zoo's tiny BERT, quantized per trial), then the same
    command with --n-trials 3: the study is continued (trials 0-1 kept, trial 2 added); Optuna's per-trial
    lines are written above the progress bar, not into it; a changed config is refused in one line."""
    config = tmp_path / "tiny.toml"
    config.write_text(SEARCH_TOML.format(run="run"))  # run_dir resolves under the output root: the working directory
    first = run_cli("search", str(config), "--results", str(tmp_path / "r1.json"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "search tiny:" in first.stderr and _optuna_lines_start_clean(first.stderr) == 2
    again = run_cli("search", str(config), "--n-trials", "3", "--results", str(tmp_path / "r2.json"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert _optuna_lines_start_clean(again.stderr) == 1 and "Trial 2 finished" in again.stderr
    one, two = (json.loads((tmp_path / f"r{i}.json").read_text())["trials"] for i in (1, 2))
    assert [t["trial"] for t in one] == [0, 1] and [t["trial"] for t in two] == [0, 1, 2]
    assert two[:2] == one
    assert all(t["weight_bits"] < json.loads((tmp_path / "r2.json").read_text())["baseline"]["weight_bits"]
               for t in two)
    config.write_text(SEARCH_TOML.format(run="run").replace("eval_size = 16", "eval_size = 32"))
    assert_one_line_error(run_cli("search", str(config), cwd=tmp_path),
                          "study 'tiny' exists, created from a different config", "--study")
