"""Check a deploy artifact in a fresh subprocess where fxforge is not importable: outputs against the graph's.

``check_artifact`` writes the cases (inputs and the fxforge graph's outputs, safetensors) to a temporary
directory, runs deploy/check_runner.py with ``python -I`` in a clean environment, and reads back the one JSON
document it prints. That output comes from another process running an arbitrary artifact, so it is parsed as
hostile input: bounded size, strict JSON, every key and type checked. A case passes when its error (relative to
the largest expected magnitude, or in quantization steps) is within the bound; a missing output, a wrong shape
or a non-finite value where the graph's is finite is a DeployError naming the output and the case, and so is a
case outside the manifest's ``axis_ranges`` (the runner refuses it, as a consumer's loader should).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..graph.atomic import dumps_json, loads_json
from ..graph.targets import CheckpointError
from .manifest import ARTIFACT_FILES, FORMATS, AxisRange, DeployCheck, DeployError, ShapeCheck

__all__ = ["CheckCase", "check_artifact", "check_summary", "RUNNER", "BOUND_KINDS"]

RUNNER = Path(__file__).resolve().parent / "check_runner.py"
BOUND_KINDS = ("relative", "quant_steps")
KEEP_ENV = ("PATH", "HOME", "TMPDIR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "TORCHINDUCTOR_CACHE_DIR")
MAX_OUTPUT_BYTES = 1 << 20
MAX_CASES = 16
TINY = 1e-12  # the denominator of a relative error when every expected value is 0
_ENTRY_KEYS = {"name", "expected_shape", "shape", "max_abs_diff", "max_abs_expected", "nonfinite_mismatches"}


@dataclass(frozen=True)
class CheckCase:
    """One input shape: the artifact's inputs by name and the fxforge graph's outputs for them, by name, in the
    artifact's output order."""

    inputs: dict[str, torch.Tensor]
    expected: dict[str, torch.Tensor]


def check_artifact(out_dir: Path, fmt: str, cases: Sequence[CheckCase], bound: float, bound_kind: str,
                   step: float = 1.0, timeout: float = 900.0,
                   ranges: Mapping[str, Mapping[int, AxisRange]] | None = None,
                   labels: Mapping[str, Mapping[int, str]] | None = None) -> DeployCheck:
    """Run ``out_dir``'s artifact of format ``fmt`` on every case in a fresh process without fxforge and
    compare its outputs with the expected ones. ``bound_kind`` ``"relative"``: error = max over outputs of
    max |runtime - expected| / max |expected|; ``"quant_steps"``: max |runtime - expected| / ``step``.
    ``ranges`` (the manifest's ``axis_ranges``, axes labelled by ``labels``) go to the runner, which refuses a
    case whose input axis is outside them, as a consumer's loader should.
    Returns the check (``passed`` False when a case's error exceeds ``bound`` or fxforge was importable);
    raises DeployError when the artifact cannot be run or its outputs are missing, misshapen or non-finite."""
    if fmt not in FORMATS:
        raise DeployError(f"check: format {fmt!r} is not one of {list(FORMATS)}")
    if bound_kind not in BOUND_KINDS:
        raise DeployError(f"check: bound_kind {bound_kind!r} is not one of {list(BOUND_KINDS)}")
    if not (math.isfinite(bound) and bound >= 0 and math.isfinite(step) and step > 0):
        raise DeployError(f"check: bound {bound} must be finite and >= 0, step {step} finite and > 0")
    if not 1 <= len(cases) <= MAX_CASES:
        raise DeployError(f"check: {len(cases)} cases given, 1 to {MAX_CASES} allowed")
    inputs, outputs = list(cases[0].inputs), list(cases[0].expected)
    if not outputs or any(list(c.inputs) != inputs or list(c.expected) != outputs for c in cases):
        raise DeployError("check: every case must have the same input names and at least one expected output, "
                          "the same for every case")
    artifact = (Path(out_dir) / ARTIFACT_FILES[fmt]).resolve()
    if not artifact.is_file():
        raise DeployError(f"check: {artifact} does not exist (export the {fmt} artifact first)")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxforge-check-") as tmp:
        spec = {"dynamic_axes": {n: {str(a): lab for a, lab in axes.items()} for n, axes in (labels or {}).items()
                                 if n in inputs},
                "axis_ranges": {n: {str(a): {"min": r.min, "max": r.max} for a, r in axes.items()}
                                for n, axes in (ranges or {}).items() if n in inputs}}
        doc = _run(Path(tmp), fmt, artifact, cases, inputs, outputs, timeout, spec)
    seconds = time.perf_counter() - start
    runtime = doc["runtime"]
    shapes = []
    for i, (case, entries) in enumerate(zip(cases, doc["cases"], strict=True)):
        where = f"{fmt} check with {runtime}, case {i} ({_shapes_text(case)})"
        error = max(_error(entry, bound_kind, step, where) for entry in entries)
        shapes.append(ShapeCheck(shapes={name: list(t.shape) for name, t in case.inputs.items()},
                                 error=error, bound=bound, bound_kind=bound_kind, passed=error <= bound))
    importable = doc["fxforge_importable"]
    return DeployCheck(runtime=runtime, fxforge_importable=importable, shapes=tuple(shapes),
                       passed=not importable and all(s.passed for s in shapes), seconds=seconds)


def check_summary(check: DeployCheck) -> str:
    """One line saying what the check found, e.g. for the CLI or an exception message."""
    verdict = "passed" if check.passed else "FAILED"
    parts = [f"{'x'.join(map(str, next(iter(s.shapes.values()), [])))}: {s.error:.3g} "
             f"({'<=' if s.passed else '>'} {s.bound:g} {s.bound_kind.replace('_', ' ')})" for s in check.shapes]
    isolation = "fxforge IMPORTABLE in the check process" if check.fxforge_importable else "without fxforge"
    return f"check {verdict} on {check.runtime} {isolation} in {check.seconds:.1f} s: " + "; ".join(parts)


def _run(tmp: Path, fmt: str, artifact: Path, cases: Sequence[CheckCase], inputs: list[str], outputs: list[str],
         timeout: float, spec: dict[str, Any]) -> dict[str, Any]:
    """Write the cases under ``tmp``, run the runner and return its validated JSON document."""
    cases_dir, work = tmp / "cases", tmp / "work"
    cases_dir.mkdir()
    work.mkdir()
    for i, case in enumerate(cases):
        save_file({k: _plain(v) for k, v in case.inputs.items()}, str(cases_dir / f"case{i}_inputs.safetensors"))
        save_file({k: _plain(v) for k, v in case.expected.items()}, str(cases_dir / f"case{i}_expected.safetensors"))
    (cases_dir / "cases.json").write_bytes(
        dumps_json({"inputs": inputs, "outputs": outputs, "cases": len(cases), **spec}, "cases.json"))
    env = {key: os.environ[key] for key in KEEP_ENV if key in os.environ}
    cmd = [sys.executable, "-I", str(RUNNER), "--format", fmt, "--artifact", str(artifact),
           "--cases", str(cases_dir)]
    out_file, err_file = tmp / "stdout", tmp / "stderr"
    with out_file.open("wb") as out, err_file.open("wb") as err:
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env=env,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise DeployError(f"{fmt} check of {artifact} did not finish within {timeout:g} s "
                              f"(the check process was killed)") from None
    raw = _read_bounded(out_file, MAX_OUTPUT_BYTES)
    try:
        doc = loads_json(raw, "check output", MAX_OUTPUT_BYTES)
    except (ValueError, CheckpointError) as exc:
        tail = _read_tail(err_file)
        raise DeployError(f"{fmt} check of {artifact}: the check process (exit {proc.returncode}) printed no valid "
                          f"result ({exc}); its stderr ends with:\n{tail}") from None
    return _validate(doc, len(cases), outputs, f"{fmt} check of {artifact}")


def _validate(doc: Any, n_cases: int, outputs: list[str], where: str) -> dict[str, Any]:
    """The runner's document, every key and type checked (it is the output of another process)."""
    if not isinstance(doc, dict) or not set(doc) <= {"fxforge_importable", "runtime", "cases", "error"}:
        raise DeployError(f"{where}: unexpected check output (not the runner's JSON object)")
    if not isinstance(doc.get("fxforge_importable"), bool):
        raise DeployError(f"{where}: check output has no fxforge_importable flag")
    if "error" in doc:
        raise DeployError(f"{where}: the runtime failed: {_text(doc['error'], where)}")
    runtime = _text(doc.get("runtime"), where, 128).replace("\n", " ")
    cases = doc.get("cases")
    if not isinstance(cases, list) or len(cases) != n_cases:
        raise DeployError(f"{where}: check output must list {n_cases} cases")
    for entries in cases:
        if not isinstance(entries, list) or len(entries) != len(outputs):
            raise DeployError(f"{where}: check output must list {len(outputs)} outputs per case")
        for name, entry in zip(outputs, entries, strict=True):
            if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS or entry["name"] != name:
                raise DeployError(f"{where}: check output entry for {name!r} is malformed")
            if not (_dims(entry["expected_shape"]) and (entry["shape"] is None or _dims(entry["shape"]))
                    and _number(entry["max_abs_diff"]) and _number(entry["max_abs_expected"])
                    and _number(entry["nonfinite_mismatches"]) and isinstance(entry["nonfinite_mismatches"], int)):
                raise DeployError(f"{where}: check output entry for {name!r} has values of the wrong type")
    return {"runtime": runtime, "fxforge_importable": doc["fxforge_importable"], "cases": cases}


def _error(entry: dict[str, Any], bound_kind: str, step: float, where: str) -> float:
    """A case's error for one output; DeployError when the output is missing, misshapen or non-finite."""
    name = entry["name"]
    if entry["shape"] is None:
        raise DeployError(f"{where}: output {name!r} is missing from the artifact's outputs")
    if entry["shape"] != entry["expected_shape"]:
        raise DeployError(f"{where}: output {name!r} has shape {entry['shape']}, the graph's has "
                          f"{entry['expected_shape']}")
    if entry["nonfinite_mismatches"]:
        raise DeployError(f"{where}: output {name!r} has {entry['nonfinite_mismatches']} non-finite values where "
                          f"the graph's differ (finite, or another non-finite value)")
    diff = float(entry["max_abs_diff"])
    scale = max(float(entry["max_abs_expected"]), TINY) if bound_kind == "relative" else step
    return min(diff / scale, 1e299)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor safetensors can save: detached, contiguous, on the CPU and owning its storage."""
    return t.detach().to("cpu").contiguous().clone()


def _shapes_text(case: CheckCase) -> str:
    return ", ".join(f"{name} {list(t.shape)}" for name, t in case.inputs.items())


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _dims(v: Any) -> bool:
    return (isinstance(v, list) and len(v) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in v))


def _text(v: Any, where: str, limit: int = 2000) -> str:
    if not isinstance(v, str):
        raise DeployError(f"{where}: check output has a non-string where text was expected")
    return "".join(ch if ch.isprintable() or ch == "\n" else "?" for ch in v[:limit])


def _read_bounded(path: Path, limit: int) -> bytes:
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise DeployError(f"check output is larger than {limit} bytes (not the runner's JSON)")
    return data


def _read_tail(path: Path, limit: int = 2000) -> str:
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - limit))
        return _text(f.read().decode("utf-8", "replace"), "stderr", limit)
