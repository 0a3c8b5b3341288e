"""The HTML report's Deploy section: each deploy directory's format, size, quantization, dynamic axes and check
table (pass/fail per shape), every manifest string escaped; ``fxforge report --deploy DIR`` (repeatable)."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_support import make_checkpoint, run_cli  # noqa: E402

from fxforge.cli.deploy_view import report_row  # noqa: E402
from fxforge.deploy import DeployCheck, DeployManifest, ShapeCheck, read_manifest  # noqa: E402
from fxforge.deploy.manifest import write_manifest  # noqa: E402

HOSTILE = '<script>alert("x")</script>&amp; int8'


def deploy_dir(path: Path, fmt: str = "onnx", quantization: str = "float", passed: bool = True,
               check: bool = True) -> Path:
    """A deploy directory as ``fxforge deploy`` leaves it (a stand-in artifact of 3,000,000 bytes)."""
    artifact = {"onnx": "model.onnx", "aoti": "model.pt2"}[fmt]
    path.mkdir(parents=True)
    (path / artifact).write_bytes(b"\0" * 3_000_000)
    shapes = (ShapeCheck({"input_ids": [2, 16], "attention_mask": [2, 16]}, 0.4, 1.0, "quant_steps", True),
              ShapeCheck({"input_ids": [3, 40], "attention_mask": [3, 40]}, 0.6 if passed else 7.0, 1.0,
                         "quant_steps", passed))
    write_manifest(path, DeployManifest(
        format=fmt, artifact=artifact, artifact_bytes=3_000_000, inputs=("input_ids", "attention_mask"),
        outputs=("logits",), dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch"}},
        quantization=quantization, source="tiny-bert",
        check=DeployCheck("onnxruntime 1.32.0", False, shapes, passed, 1.5) if check else None))
    return path


def section(page: str) -> str:
    """The Deploy section of a report page."""
    found = re.search(r"<section id='deploy'>(.*?)</section>", page, re.S)
    assert found is not None, "no Deploy section"
    return found.group(1)


def facts(part: str, k: int) -> dict[str, str]:
    """The fact table of the k-th artifact, unescaped."""
    table = re.search(rf'<table id="deploy-{k}">(.*?)</table>', part, re.S)
    assert table is not None, part
    return {html.unescape(a): html.unescape(b)
            for a, b in re.findall(r'<tr class="deploy-fact"><td>(.*?)</td><td>(.*?)</td></tr>', table.group(1))}


def check_rows(part: str) -> list[list[str]]:
    """The cells of every check table row, unescaped."""
    return [[html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", row)]
            for row in re.findall(r'<tr class="deploy-check-row">(.*?)</tr>', part)]


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> object:
    from fxforge import ForgeGraph

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(path)
    return ForgeGraph.from_checkpoint(path)


def test_deploy_section_shows_each_artifact_and_its_check_table(graph: object, tmp_path: Path) -> None:
    from fxforge.report import build_report

    onnx = deploy_dir(tmp_path / "bert-onnx", quantization="qdq int8 (12 layers)")
    aoti = deploy_dir(tmp_path / "bert-aoti", fmt="aoti", passed=False)
    rows = [report_row(read_manifest(d), d) for d in (onnx, aoti)]
    part = section(build_report(graph, deploy=rows))  # type: ignore[arg-type]
    assert f"<h3>{onnx}</h3>" in part and f"<h3>{aoti}</h3>" in part
    first, second = facts(part, 0), facts(part, 1)
    assert first["format"] == "onnx" and first["artifact"] == "model.onnx: 3.00 MB (3,000,000 bytes)"
    assert second["format"] == "aoti" and second["artifact"] == "model.pt2: 3.00 MB (3,000,000 bytes)"
    assert first["quantization"] == "qdq int8 (12 layers)" and second["quantization"] == "float"
    assert first["dynamic axes"] == "input_ids[0]=batch, input_ids[1]=seq, logits[0]=batch"
    assert first["inputs"] == "input_ids, attention_mask" and first["source"] == "tiny-bert"
    assert check_rows(part) == [["input_ids, attention_mask 2x16", "0.4", "1", "quant_steps", "pass"],
                                ["input_ids, attention_mask 3x40", "0.6", "1", "quant_steps", "pass"],
                                ["input_ids, attention_mask 2x16", "0.4", "1", "quant_steps", "pass"],
                                ["input_ids, attention_mask 3x40", "7", "1", "quant_steps", "FAIL"]]
    assert part.count("fxforge importable: <b>no</b>") == 2
    assert part.count("<b>pass</b>") == 1 and part.count("<b>FAIL</b>") == 1


def test_deploy_section_escapes_hostile_manifest_strings(graph: object, tmp_path: Path) -> None:
    from fxforge.report import build_report

    evil = tmp_path / "<img src=x onerror=alert(1)>"
    d = deploy_dir(evil, quantization=HOSTILE)
    page = build_report(graph, deploy=[report_row(read_manifest(d), d)])  # type: ignore[arg-type]
    part = section(page)
    assert "<script>alert" not in page and "<img src=x" not in page
    assert f"<td>{html.escape(HOSTILE)}</td>" in part and facts(part, 0)["quantization"] == HOSTILE
    assert "&lt;img src=x onerror=alert(1)&gt;" in part


def test_deploy_section_without_artifacts_or_check(graph: object, tmp_path: Path) -> None:
    from fxforge.report import build_report

    assert "--deploy DIR" in section(build_report(graph))  # type: ignore[arg-type]
    d = deploy_dir(tmp_path / "unchecked", check=False)
    part = section(build_report(graph, deploy=[report_row(read_manifest(d), d)]))  # type: ignore[arg-type]
    assert "No check recorded" in part and "deploy-check-row" not in part


def test_report_cli_takes_repeated_deploy_dirs(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt)
    one = deploy_dir(tmp_path / "one", quantization=HOSTILE)
    two = deploy_dir(tmp_path / "two", fmt="aoti")
    out = tmp_path / "r.html"
    proc = run_cli("report", str(ckpt), "-o", str(out), "--deploy", str(one), "--deploy", str(two))
    assert proc.returncode == 0, proc.stderr
    part = section(out.read_text())
    assert part.count("<h3>") == 2 and len(check_rows(part)) == 4
    assert "<script>" not in part and html.escape(HOSTILE) in part

    (two / "deploy.json").write_text('{"version": 2}')
    proc = run_cli("report", str(ckpt), "-o", str(tmp_path / "r2.html"), "--deploy", str(two))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "deploy.json" in lines[0], proc.stderr
    assert not (tmp_path / "r2.html").exists()
