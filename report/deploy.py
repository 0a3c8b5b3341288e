"""The report's "Deploy" section: each deploy artifact's format, size, quantization, dynamic axes (with the sizes
each accepts) and check.

The report builds on passes only, so it does not read ``deploy.json`` itself: the caller (the CLI) reads the
manifest through ``fxforge.deploy`` and hands over these plain rows. Every string in them came from a file and
is escaped here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["DeployArtifactRow", "DeployShapeRow", "deploy_section"]


@dataclass(frozen=True)
class DeployShapeRow:
    """One input shape of the subprocess check: the shapes (``input_ids 2x16, ...``), the error, the bound
    (with its kind: ``relative`` or ``quant_steps``) and whether the error was within it."""

    shapes: str
    error: float
    bound: float
    bound_kind: str
    passed: bool


@dataclass(frozen=True)
class DeployArtifactRow:
    """One deploy directory as the report shows it. ``runtime`` is empty when no check was recorded."""

    directory: str
    format: str
    artifact: str
    artifact_bytes: int
    quantization: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: str  # e.g. "input_ids[1]=seq in 2..64, logits[0]=batch (= input_ids[0])"
    runtime: str = ""
    fxforge_importable: bool = False
    check_passed: bool = False
    check_seconds: float = 0.0
    shapes: tuple[DeployShapeRow, ...] = ()


def _table(table_id: str, header: Sequence[str], rows: Sequence[Sequence[str]], row_class: str,
           sortable: bool = True) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "\n".join(f'<tr class="{row_class}">' + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>"
                     for r in rows)
    kind = ' class="sortable"' if sortable else ""
    return f'<table id="{table_id}"{kind}><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>'


def _verdict(passed: bool) -> str:
    return "pass" if passed else "FAIL"


def _artifact(k: int, a: DeployArtifactRow) -> str:
    facts = [("format", a.format), ("artifact", f"{a.artifact}: {a.artifact_bytes / 1e6:.2f} MB "
                                                f"({a.artifact_bytes:,} bytes)"),
             ("quantization", a.quantization), ("source", a.source or "(not recorded)"),
             ("inputs", ", ".join(a.inputs)), ("outputs", ", ".join(a.outputs)),
             ("dynamic axes", a.dynamic_axes or "none")]  # with their allowed sizes when recorded
    parts = [f"<h3>{escape(a.directory)}</h3>",
             _table(f"deploy-{k}", ["", ""], [list(f) for f in facts], "deploy-fact", sortable=False)]
    if not a.runtime:
        parts.append("<p class='deploy-check'>No check recorded: the artifact was not run outside fxforge.</p>")
        return "\n".join(parts)
    importable = "yes" if a.fxforge_importable else "no"
    parts.append(f"<p class='deploy-check'>Check in a fresh subprocess: runtime <b>{escape(a.runtime)}</b>, fxforge "
                 f"importable: <b>{importable}</b>, {a.check_seconds:.1f} s, "
                 f"<b>{_verdict(a.check_passed)}</b>.</p>")
    rows = [[s.shapes, f"{s.error:.3g}", f"{s.bound:.3g}", s.bound_kind, _verdict(s.passed)] for s in a.shapes]
    parts.append(_table(f"deploy-check-{k}", ["input shapes", "error", "bound", "bound kind", "result"], rows,
                        "deploy-check-row"))
    return "\n".join(parts)


def deploy_section(artifacts: Sequence[DeployArtifactRow] | None) -> str:
    """The body of the report's Deploy section (HTML, every value escaped)."""
    if not artifacts:
        return "<p>No deploy artifact given (<code>fxforge report CKPT --deploy DIR</code>).</p>"
    return "\n".join(_artifact(k, a) for k, a in enumerate(artifacts))
