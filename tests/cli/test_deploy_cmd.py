"""``fxforge deploy`` and ``fxforge inspect DEPLOY_DIR`` in a subprocess: the printed artifact, signature and
subprocess check, one-line errors for malformed manifests and failed exports, usage errors for bad formats."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from cli_support import make_checkpoint, run_cli

from fxforge.deploy import DeployCheck, DeployError, DeployManifest, ShapeCheck, read_manifest
from fxforge.deploy.manifest import write_manifest


def deploy_dir(path: Path, quantization: str = "float", passed: bool = True, artifact_bytes: int = 4321) -> Path:
    """A deploy directory as ``fxforge deploy`` leaves it: a (stand-in) artifact and its manifest."""
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(b"\0" * artifact_bytes)
    shapes = (ShapeCheck({"input_ids": [2, 16], "attention_mask": [2, 16]}, 3.2e-7, 1e-4, "relative", True),
              ShapeCheck({"input_ids": [5, 37], "attention_mask": [5, 37]}, 4.1e-7 if passed else 0.25, 1e-4,
                         "relative", passed))
    manifest = DeployManifest(
        format="onnx", artifact="model.onnx", artifact_bytes=artifact_bytes, inputs=("input_ids", "attention_mask"),
        outputs=("logits",), dynamic_axes={"input_ids": {0: "batch", 1: "seq"},
                                           "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}},
        quantization=quantization, source="tiny-bert",
        check=DeployCheck("onnxruntime 1.32.0", False, shapes, passed, 2.5))
    write_manifest(path, manifest)
    return path


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("fxforge: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_inspect_deploy_dir_shows_artifact_signature_and_check(tmp_path: Path) -> None:
    path = deploy_dir(tmp_path / ("a-directory-name-long-enough-that-the-path-is-wider-than-the-terminal-" * 2))
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"artifact:     {path / 'model.onnx'}\nsize:         0.00 MB (4,321 bytes)\n" in out
    assert "format:       onnx\n" in out and "quantization: float\n" in out and "source:       tiny-bert\n" in out
    flat = " ".join(out.split())
    assert "inputs: input_ids (dim 0: batch, dim 1: seq), attention_mask (dim 0: batch, dim 1: seq)" in flat
    assert "outputs: logits (dim 0: batch)" in flat
    assert "check: passed in a fresh subprocess: onnxruntime 1.32.0, fxforge importable: no, 2.5 s" in flat
    rows = [line.split() for line in out.splitlines() if line.startswith("  input_ids")]
    assert rows == [["input_ids,", "attention_mask", "2x16", "3.2e-07", "0.0001", "relative", "pass"],
                    ["input_ids,", "attention_mask", "5x37", "4.1e-07", "0.0001", "relative", "pass"]]
    # run_cli sets COLUMNS=100: every line fits but the artifact's path, kept whole on its label's line
    assert max(len(line) for line in out.splitlines() if not line.startswith("artifact:")) <= 100
    assert "nodes" not in out  # no graph was captured or loaded


def summary_at(path: Path, columns: int, monkeypatch: pytest.MonkeyPatch) -> str:
    from fxforge.cli.inspect_cmd import deploy_summary

    monkeypatch.setenv("COLUMNS", str(columns))  # the summary wraps to the terminal (make's may be 80 wide)
    return deploy_summary(path)


def test_inspect_deploy_dir_wraps_to_a_narrow_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = summary_at(deploy_dir(Path("d")), 60, monkeypatch)
    assert max(len(line) for line in text.splitlines()) <= 60, text
    flat = " ".join(text.split())
    assert "fxforge importable: no" in flat and "attention_mask (dim 0: batch, dim 1: seq)" in flat


def test_inspect_deploy_dir_flags_a_failed_check_and_a_changed_artifact(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = deploy_dir(tmp_path / "d", passed=False)
    (path / "model.onnx").write_bytes(b"\0" * 10)
    text = summary_at(path, 160, monkeypatch)
    flat = " ".join(text.split())
    assert "check: FAILED in a fresh subprocess: onnxruntime" in flat
    assert re.search(r"5x37 +0\.25 +0\.0001 relative +FAIL", text), text
    assert "CHANGED: 10 bytes on disk now" in flat
    (path / "model.onnx.data").write_bytes(b"\0" * 4311)  # external weights count as the export counts them
    assert "CHANGED" not in summary_at(path, 160, monkeypatch)
    (path / "model.onnx").unlink()
    assert "MISSING: no model.onnx in" in " ".join(summary_at(path, 160, monkeypatch).split())


def test_inspect_prints_hostile_manifest_strings_without_terminal_controls(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = deploy_dir(tmp_path / "d", quantization="qdq \u009b31m int8 \u202e")  # C1 CSI, bidi override
    text = summary_at(path, 160, monkeypatch)
    assert "quantization: qdq ?31m int8 ?\n" in text
    assert "\u009b" not in text and "\u202e" not in text


def test_inspect_malformed_manifest_is_one_line(tmp_path: Path) -> None:
    path = deploy_dir(tmp_path / "d")
    doc = json.loads((path / "deploy.json").read_text())
    doc["check"]["passed"] = "yes"
    (path / "deploy.json").write_text(json.dumps(doc))
    assert_one_line_error(run_cli("inspect", str(path)), "deploy.json", "check.passed must be true or false")
    (path / "deploy.json").write_text('{"version": 1, "format": "on')
    assert_one_line_error(run_cli("inspect", str(path)), "deploy.json: invalid JSON")


@pytest.mark.parametrize("text,fragment", [
    ("[]", "must be a JSON object"),
    (json.dumps({"version": 1, "format": "tflite"}), "missing keys"),
])
def test_inspect_summary_refuses_malformed_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                                     fragment: str) -> None:
    path = deploy_dir(tmp_path / "d")
    (path / "deploy.json").write_text(text)
    with pytest.raises(DeployError, match=re.escape(fragment)):
        summary_at(path, 100, monkeypatch)


def test_unknown_format_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_cli("deploy", "tiny-bert", "--format", "tflite", "-o", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "'tflite' is not a deploy format; choose one of onnx, aoti" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert run_cli("deploy", "tiny-bert").returncode == 2  # --format is required


def test_default_out_is_model_name_and_format() -> None:
    from fxforge.cli.deploy import default_out

    assert default_out("tiny-bert", "onnx") == Path("tiny-bert-onnx")
    assert default_out("ckpt/minilm.v1/", "aoti") == Path("minilm.v1-aoti")
    assert default_out("org/name", "onnx") == Path("name-onnx")



@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``fxforge deploy tiny-bert --format onnx`` run once, without -o, in a fresh directory."""
    cwd = tmp_path_factory.mktemp("deploy")
    return run_cli("deploy", "tiny-bert", "--format", "onnx", cwd=cwd), cwd / "tiny-bert-onnx"


def check_table(out: str) -> list[list[str]]:
    """The rows of the printed check table (after its header rule)."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("  ---"))
    return [line.split() for line in lines[rule + 1:] if line.startswith("  ")]


def test_deploy_zoo_model_to_onnx_prints_size_and_check(deployed: tuple[subprocess.CompletedProcess[str], Path]) \
        -> None:
    proc, path = deployed
    assert proc.returncode == 0, proc.stderr[-3000:]
    size = (path / "model.onnx").stat().st_size
    out = proc.stdout
    assert out.startswith("deployed zoo model tiny-bert: ") and " as onnx to tiny-bert-onnx\n" in out
    assert "artifact:     tiny-bert-onnx/model.onnx\n" in out
    assert f"size:         {size / 1e6:.2f} MB ({size:,} bytes)\n" in out
    assert "quantization: float\n" in out
    flat = " ".join(out.split())  # with the sizes each dynamic axis accepts (deploy.json's axis_ranges)
    assert "inputs: input_ids (dim 0: batch >= 1, dim 1: seq in 2..128), attention_mask (dim 0: batch >= 1, dim 1: " \
           "seq in 2..128) outputs: logits (dim 0: batch = input_ids[0])" in flat  # the zoo model's 128 positions
    assert "check:        passed in a fresh subprocess: onnxruntime " in out and "fxforge importable: no" in out
    rows = check_table(out)
    assert len(rows) == 2 and all(r[-3:] == ["0.0001", "relative", "pass"] for r in rows), rows
    assert rows[0][2] != rows[1][2]  # two different input shapes
    assert all(float(r[3]) < 1e-4 for r in rows)
    assert max(len(line) for line in out.splitlines()) <= 100


def test_inspect_real_deploy_dir_shows_the_same_check(deployed: tuple[subprocess.CompletedProcess[str], Path]) \
        -> None:
    proc, path = deployed
    shown = run_cli("inspect", str(path))
    assert shown.returncode == 0, shown.stderr
    assert check_table(shown.stdout) == check_table(proc.stdout)
    assert "CHANGED" not in shown.stdout and "MISSING" not in shown.stdout


def test_report_shows_a_real_deploy_check(deployed: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    from fxforge import ForgeGraph
    from fxforge.cli.deploy_view import report_row
    from fxforge.cli.inspect_cmd import ensure_metadata
    from fxforge.models.zoo import build
    from fxforge.report import build_report

    zoo = build("tiny-bert")
    page = build_report(ensure_metadata(ForgeGraph(zoo.model, **zoo.capture)),
                        deploy=[report_row(read_manifest(deployed[1]), deployed[1])])
    part = page[page.index("<section id='deploy'>"):]
    assert part.count('<tr class="deploy-check-row">') == 2 and part.count("<td>pass</td>") == 2


def test_deploy_into_a_non_artifact_directory_exits_1_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    (out / "sub" / "data.bin").write_bytes(b"\1\2\3")
    before = sorted((p.relative_to(out), p.read_bytes() if p.is_file() else None) for p in out.rglob("*"))
    proc = run_cli("deploy", "tiny-bert", "--format", "onnx", "-o", str(out))
    assert_one_line_error(proc, str(out), "not a deploy directory", "never deleted")
    assert sorted((p.relative_to(out), p.read_bytes() if p.is_file() else None) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staged sibling left behind


def test_deploy_quantized_checkpoint_as_qdq(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "ckpt")
    proc = run_cli("deploy", str(tmp_path / "ckpt"), "--format", "onnx", "-o", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^quantization: qdq int8 \(\d+ layers", proc.stdout, re.M), proc.stdout
    rows = check_table(proc.stdout)
    assert len(rows) == 2 and all(r[-4:] == ["1", "quant", "steps", "pass"] for r in rows), rows
    assert read_manifest(tmp_path / "out").quantization.startswith("qdq int8")
