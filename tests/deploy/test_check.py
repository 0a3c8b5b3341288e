"""deploy/check.py and check_runner.py: artifacts of a tiny module run in a fresh process without fxforge, at two
shapes; a wrong artifact, a missing or misshapen output, a hang and a runner printing garbage are clear errors."""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxforge.deploy.check import RUNNER, CheckCase, check_artifact, check_summary
from fxforge.deploy.manifest import DeployError


class Tiny(nn.Module):
    """Two outputs (a projection and a masked sum) of two named inputs, dynamic in batch and sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.proj(x)) * mask.unsqueeze(-1), (x * mask.unsqueeze(-1)).sum(1)


@pytest.fixture(scope="module")
def model() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


def _program(model: Tiny) -> torch.export.ExportedProgram:
    batch, seq = torch.export.Dim("batch", min=1, max=32), torch.export.Dim("seq", min=2, max=64)
    with torch.no_grad():
        return torch.export.export(model, (torch.randn(2, 5, 8), torch.ones(2, 5)),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))


@contextlib.contextmanager
def _torch_export_noise() -> Iterator[None]:
    """torch 2.13's exporters warn about torch's own deprecated APIs (pytree's LeafSpec, imported from copyreg;
    inductor importing torch.jit.script_method); pytest.ini turns those into errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*LeafSpec.* is deprecated", FutureWarning)
        warnings.filterwarnings("ignore", r".*torch\.jit\.script_method.* is deprecated", DeprecationWarning)
        yield


@pytest.fixture(scope="module")
def onnx_dir(model: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("onnx")
    with _torch_export_noise():
        program = torch.onnx.export(_program(model), (), dynamo=True, input_names=["x", "mask"],
                                    output_names=["y", "total"], verbose=False)
    program.save(str(out / "model.onnx"))
    return out


@pytest.fixture(scope="module")
def aoti_dir(model: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("aoti")
    with _torch_export_noise():
        torch._inductor.aoti_compile_and_package(_program(model), package_path=str(out / "model.pt2"))
    return out


def _cases(model: Tiny, shapes: tuple[tuple[int, int], ...] = ((2, 5), (3, 11))) -> list[CheckCase]:
    gen = torch.Generator().manual_seed(1)
    cases = []
    for batch, seq in shapes:
        x, mask = torch.randn(batch, seq, 8, generator=gen), torch.ones(batch, seq)
        mask[-1, seq // 2:] = 0
        with torch.no_grad():
            y, total = model(x, mask)
        cases.append(CheckCase(inputs={"x": x, "mask": mask}, expected={"y": y, "total": total}))
    return cases


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("aoti", marks=pytest.mark.slow_deploy)])  # make test-deploy
def test_correct_artifact_passes_at_two_shapes(fmt: str, model: Tiny, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue(f"{fmt}_dir")
    check = check_artifact(out, fmt, _cases(model), bound=1e-4, bound_kind="relative")
    assert check.passed and not check.fxforge_importable
    assert check.runtime.startswith("onnxruntime 1." if fmt == "onnx" else "torch.aoti 2.")
    assert [s.shapes for s in check.shapes] == [{"x": [2, 5, 8], "mask": [2, 5]}, {"x": [3, 11, 8], "mask": [3, 11]}]
    assert all(s.passed and s.error < 1e-5 and s.bound == 1e-4 and s.bound_kind == "relative" for s in check.shapes)
    assert check.seconds > 0
    assert "check passed" in check_summary(check) and "without fxforge" in check_summary(check)


def test_perturbed_expected_fails_with_measured_error(model: Tiny, onnx_dir: Path) -> None:
    cases = _cases(model)
    y = cases[1].expected["y"].clone()
    y[0, 0, 0] += 0.01 * float(y.abs().max())
    cases[1] = CheckCase(inputs=cases[1].inputs, expected={"y": y, "total": cases[1].expected["total"]})
    check = check_artifact(onnx_dir, "onnx", cases, bound=1e-4, bound_kind="relative")
    assert not check.passed and check.shapes[0].passed and not check.shapes[1].passed
    assert check.shapes[1].error == pytest.approx(0.01, rel=1e-3)
    assert "FAILED" in check_summary(check) and "> 0.0001 relative" in check_summary(check)


def test_quant_steps_bound(model: Tiny, onnx_dir: Path) -> None:
    """Errors in units of a step: the exact artifact is within 1 step; a 5-step shift of one value is not."""
    cases = _cases(model)
    assert check_artifact(onnx_dir, "onnx", cases, bound=1.0, bound_kind="quant_steps", step=1e-3).passed
    total = cases[0].expected["total"].clone()
    total[1, 2] += 5e-3
    cases[0] = CheckCase(inputs=cases[0].inputs, expected={"y": cases[0].expected["y"], "total": total})
    check = check_artifact(onnx_dir, "onnx", cases, bound=1.0, bound_kind="quant_steps", step=1e-3)
    assert not check.passed and check.shapes[0].error == pytest.approx(5.0, rel=1e-3)


def test_missing_output_is_named(model: Tiny, onnx_dir: Path) -> None:
    cases = [CheckCase(c.inputs, {**c.expected, "logits": c.expected["y"]}) for c in _cases(model)]
    with pytest.raises(DeployError, match=r"case 0 \(x \[2, 5, 8\], mask \[2, 5\]\): output 'logits' is missing"):
        check_artifact(onnx_dir, "onnx", cases, bound=1e-4, bound_kind="relative")


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("aoti", marks=pytest.mark.slow_deploy)])
def test_wrong_shape_is_named(fmt: str, model: Tiny, request: pytest.FixtureRequest) -> None:
    cases = [CheckCase(c.inputs, {"y": c.expected["y"][:, :-1], "total": c.expected["total"]}) for c in _cases(model)]
    with pytest.raises(DeployError, match=r"output 'y' has shape \[2, 5, 4\], the graph's has \[2, 4, 4\]"):
        check_artifact(request.getfixturevalue(f"{fmt}_dir"), fmt, cases, bound=1e-4, bound_kind="relative")


def test_non_finite_output_where_expected_is_finite(model: Tiny, onnx_dir: Path) -> None:
    """An infinite input makes the artifact's ``total`` infinite where the graph's outputs (clean input) are not."""
    cases = _cases(model)
    x = cases[0].inputs["x"].clone()
    x[0, 0, 0] = float("inf")
    cases[0] = CheckCase({"x": x, "mask": cases[0].inputs["mask"]}, cases[0].expected)
    with pytest.raises(DeployError, match=r"output 'total' has 1 non-finite values"):
        check_artifact(onnx_dir, "onnx", cases, bound=1e-4, bound_kind="relative")


def test_timeout_is_clear(model: Tiny, onnx_dir: Path) -> None:
    with pytest.raises(DeployError, match=r"did not finish within 0.2 s \(the check process was killed\)"):
        check_artifact(onnx_dir, "onnx", _cases(model), bound=1e-4, bound_kind="relative", timeout=0.2)


def test_unloadable_artifact_and_missing_artifact(model: Tiny, tmp_path: Path) -> None:
    with pytest.raises(DeployError, match=r"model.onnx does not exist"):
        check_artifact(tmp_path, "onnx", _cases(model), bound=1e-4, bound_kind="relative")
    (tmp_path / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(DeployError, match=r"the runtime failed: .*(Protobuf|parsing|INVALID)"):
        check_artifact(tmp_path, "onnx", _cases(model), bound=1e-4, bound_kind="relative")


@pytest.mark.parametrize(("printed", "message"), [
    ("print('hello')", r"printed no valid result"),
    ("print('{\"fxforge_importable\": false, \"runtime\": \"x\", \"cases\": NaN}')", r"printed no valid result"),
    ("import sys; sys.stdout.write('[' * 3000000)", r"larger than 1048576 bytes"),
    ("print('{\"fxforge_importable\": false, \"runtime\": \"x\", \"cases\": [[{}]]}')", r"must list 2 cases"),
    ("import sys; sys.stderr.write('boom'); sys.exit(3)", r"(?s)\(exit 3\) printed no valid result.*boom"),
])
def test_hostile_runner_output_is_a_clear_error(printed: str, message: str, model: Tiny, onnx_dir: Path,
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's stdout is another process's output: garbage, NaN, huge or malformed JSON is refused."""
    fake = tmp_path / "fake_runner.py"
    fake.write_text(printed + "\n")
    monkeypatch.setattr("fxforge.deploy.check.RUNNER", fake)
    with pytest.raises(DeployError, match=message):
        check_artifact(onnx_dir, "onnx", _cases(model), bound=1e-4, bound_kind="relative")


def test_check_fails_when_runner_reports_fxforge_importable(model: Tiny, onnx_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose block did not hold (here: one that never installs it) fails the check, errors within bound."""
    fake = tmp_path / "leaky_runner.py"
    fake.write_text(RUNNER.read_text().replace("    block_fxforge()\n    out =", "    out ="))
    monkeypatch.setattr("fxforge.deploy.check.RUNNER", fake)
    check = check_artifact(onnx_dir, "onnx", _cases(model), bound=1e-4, bound_kind="relative")
    assert check.fxforge_importable and not check.passed and all(s.passed for s in check.shapes)
    assert "fxforge IMPORTABLE" in check_summary(check)


def _python(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=RUNNER.parent.parent, check=False)


def test_runner_block_makes_fxforge_unimportable() -> None:
    """In a plain interpreter started in the checkout fxforge imports (editable install); after the runner's
    block neither fxforge nor a submodule does, and no sys.path entry reaches the checkout."""
    assert _python("import fxforge").returncode == 0
    code = (f"import runpy, sys\nns = runpy.run_path({str(RUNNER)!r})\nns['block_fxforge']()\n"
            "assert not ns['fxforge_importable']()\n"
            "for name in ('fxforge', 'fxforge.deploy', 'fxforge.graph.atomic'):\n"
            "    try:\n        __import__(name)\n"
            "    except ModuleNotFoundError as e:\n        print('blocked', name, 'by', e.name)\n"
            "    else:\n        print('IMPORTED', name)\n"
            "print('path', any(ns['_exposes_checkout'](p) for p in sys.path))\n")
    for flags in ((), ("-I",)):
        run = _python(code, *flags)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split("\n")[:4] == ["blocked fxforge by fxforge",
                                              "blocked fxforge.deploy by fxforge",
                                              "blocked fxforge.graph.atomic by fxforge", "path False"]


def test_runner_imports_nothing_from_fxforge() -> None:
    """The runner is a standalone script: stdlib, numpy, torch, the runtimes (onnxruntime, executorch) and
    safetensors; no relative import."""
    allowed = set(sys.stdlib_module_names) | {"numpy", "torch", "onnxruntime", "executorch", "safetensors"}
    imported = set()
    for node in ast.walk(ast.parse(RUNNER.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, "relative import in check_runner.py"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
    assert imported <= allowed and "fxforge" not in imported
    assert {"torch", "onnxruntime", "safetensors"} <= imported


def test_runner_check_ranges_reads_a_deploy_json() -> None:
    """A consumer without fxforge checks its inputs against deploy.json's axis_ranges with the runner's
    check_ranges; a version 1 manifest (no ranges) passes anything."""
    import runpy

    check_ranges = runpy.run_path(str(RUNNER))["check_ranges"]
    manifest = {"dynamic_axes": {"x": {"0": "batch", "1": "seq"}},
                "axis_ranges": {"x": {"0": {"min": 1, "max": 8}, "1": {"min": 2, "max": None}}}}
    check_ranges({"x": torch.zeros(8, 2, 8), "mask": torch.zeros(9, 1)}, manifest)  # mask has no range
    with pytest.raises(ValueError, match=r"input 'x' axis 0 \(batch\) has size 9, outside the artifact's range 1\.\.8"):
        check_ranges({"x": torch.zeros(9, 5, 8)}, manifest)
    with pytest.raises(ValueError, match=r"input 'x' axis 1 \(seq\) has size 1, outside the artifact's range 2\.\."):
        check_ranges({"x": torch.zeros(2, 1, 8)}, manifest)
    check_ranges({"x": torch.zeros(99, 1, 8)}, {"dynamic_axes": {"x": {"0": "batch"}}})
