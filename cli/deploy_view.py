"""How a deploy directory's manifest is shown: lines for the terminal and rows for the HTML report.

``fxforge deploy`` and ``fxforge inspect DEPLOY_DIR`` print :func:`manifest_lines`; ``fxforge report --deploy``
passes :func:`report_row` to the report (which builds on passes only and so never reads ``deploy.json``). The
manifest is a file: its strings are printed with anything unprintable replaced.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..deploy import MANIFEST_NAME, DeployManifest, ShapeCheck
from ..deploy.output_dir import DEPLOY_FILES
from ..passes.analysis.table import format_table
from ..report.deploy import DeployArtifactRow, DeployShapeRow

__all__ = ["artifact_size", "axes_text", "manifest_lines", "report_row", "shapes_text", "size_text"]


def _safe(text: str) -> str:
    """``text`` with characters a terminal could act on (escapes, C1 controls) shown as ``?``."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def size_text(n: int) -> str:
    """``1.23 MB (1,234,567 bytes)``."""
    return f"{n / 1e6:.2f} MB ({n:,} bytes)"


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def artifact_size(manifest: DeployManifest, directory: Path) -> int | None:
    """The bytes of the artifact in ``directory`` now, counted as the export counts them (the artifact and any
    external-data file beside it); None when the artifact is not a regular file there."""
    if not _regular(directory / manifest.artifact):
        return None
    return sum((directory / name).stat().st_size for name in DEPLOY_FILES
               if name != MANIFEST_NAME and _regular(directory / name))


def _sizes(manifest: DeployManifest, name: str, axis: int, paren: bool = False) -> str:
    """The sizes an axis accepts as recorded (version 2): `` in 2..64``, `` >= 1`` or, for an output's axis, the
    input axis it follows (`` = input_ids[0]``, in parentheses when ``paren``); "" when none is recorded."""
    r = manifest.axis_ranges.get(name, {}).get(axis)
    if r is None:
        return ""
    if r.follows:
        return f" (= {r.follows})" if paren else f" = {r.follows}"
    return f" in {r.min}..{r.max}" if r.max is not None else f" >= {r.min}"


def _tensor(name: str, manifest: DeployManifest, static_when_absent: bool) -> str:
    """``name (dim 0: batch >= 1, dim 1: seq in 2..64)``; an input without dynamic axes is static, an output's may
    be unrecorded (``logits (dim 0: batch = input_ids[0])``: logits' batch is the input's)."""
    axes = manifest.dynamic_axes.get(name)
    if not axes:
        return f"{name} (static)" if static_when_absent else name
    return f"{name} (" + ", ".join(f"dim {axis}: {label}{_sizes(manifest, name, axis)}"
                                   for axis, label in sorted(axes.items())) + ")"


def axes_text(manifest: DeployManifest) -> str:
    """The dynamic axes of every input and output with their sizes, ``input_ids[0]=batch >= 1, input_ids[1]=seq
    in 2..64, logits[0]=batch (= input_ids[0])`` ("" if none)."""
    return ", ".join(f"{name}[{axis}]={label}{_sizes(manifest, name, axis, paren=True)}"
                     for name, axes in manifest.dynamic_axes.items() for axis, label in sorted(axes.items()))


def shapes_text(check: ShapeCheck) -> str:
    """The input shapes of one check, inputs of equal shape grouped: ``input_ids, attention_mask 2x16``."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, dims in check.shapes.items():
        groups.setdefault(tuple(dims), []).append(name)
    return "; ".join(", ".join(names) + " " + ("x".join(map(str, dims)) or "scalar") for dims, names in groups.items())


def _bound(check: ShapeCheck) -> str:
    return f"{check.bound:.3g} relative" if check.bound_kind == "relative" else f"{check.bound:.3g} quant steps"


def manifest_lines(manifest: DeployManifest, directory: Path, width: int) -> list[str]:
    """The manifest as terminal lines wrapped to ``width``; an artifact changed or removed since its check is
    pointed out (its size on disk differs from the manifest's)."""
    pad = " " * 14
    artifact = directory / manifest.artifact
    size, on_disk = size_text(manifest.artifact_bytes), artifact_size(manifest, directory)
    if on_disk is None:
        size += f"; MISSING: no {manifest.artifact} in {directory}"
    elif on_disk != manifest.artifact_bytes:
        size += f"; CHANGED: {on_disk:,} bytes on disk now, so the check below is not about this file"
    rows = [("artifact:", str(artifact)), ("size:", size),
            ("format:", manifest.format),
            ("quantization:", manifest.quantization),
            ("source:", manifest.source or "(not recorded)"),
            ("inputs:", ", ".join(_tensor(n, manifest, True) for n in manifest.inputs)),
            ("outputs:", ", ".join(_tensor(n, manifest, False) for n in manifest.outputs))]
    lines: list[str] = []
    for label, value in rows:  # the path stays on its label's line, whole (copyable), however wide the terminal
        if label == "artifact:":
            lines.append(f"{label:<14}{_safe(value)}")
            continue
        lines += textwrap.wrap(f"{label:<14}{_safe(value)}", width, subsequent_indent=pad, break_on_hyphens=False)
    check = manifest.check
    if check is None:
        return [*lines, "check:        not run (the artifact was not checked outside fxforge)"]
    verdict = "passed" if check.passed else "FAILED"
    head = (f"check:        {verdict} in a fresh subprocess: {_safe(check.runtime)}, fxforge importable: "
            f"{'yes' if check.fxforge_importable else 'no'}, {check.seconds:.1f} s")
    lines += textwrap.wrap(head, width, subsequent_indent=pad)
    table = [{"input shapes": _safe(shapes_text(s)), "error": f"{s.error:.3g}", "bound": _bound(s),
              "result": "pass" if s.passed else "FAIL"} for s in check.shapes]
    if table:
        lines += ["  " + line for line in format_table(table, list(table[0]), max_width=width - 2).splitlines()]
    return lines


def report_row(manifest: DeployManifest, directory: Path) -> DeployArtifactRow:
    """The plain row the HTML report shows for the deploy directory ``directory``."""
    check = manifest.check
    shapes = () if check is None else tuple(
        DeployShapeRow(shapes_text(s), s.error, s.bound, s.bound_kind, s.passed) for s in check.shapes)
    return DeployArtifactRow(
        directory=str(directory), format=manifest.format, artifact=manifest.artifact,
        artifact_bytes=manifest.artifact_bytes, quantization=manifest.quantization, source=manifest.source,
        inputs=manifest.inputs, outputs=manifest.outputs, dynamic_axes=axes_text(manifest),
        runtime="" if check is None else check.runtime, fxforge_importable=bool(check and check.fxforge_importable),
        check_passed=manifest.passed, check_seconds=0.0 if check is None else check.seconds, shapes=shapes)
