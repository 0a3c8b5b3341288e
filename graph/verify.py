"""Verify a checkpoint end to end: manifest, allowlist, reload, run, and equality to the recorded outputs.

What each check means: *manifest* -- every listed file has the recorded size and SHA-256 (nothing was
corrupted after export; anyone can re-hash edited files, so the manifest's own SHA-256 is printed: the
digest a publisher shares and users pin with ``expected_sha256``); *allowlist* -- every call target,
module class and pytree type resolves through graph/targets (no pickle, no import, no exec); *reload* --
the graph and metadata rebuild and lint; *run* -- the reloaded graph runs on the checkpoint's example
inputs; *outputs* -- those outputs equal the ones recorded at export within ``atol``. Checks that cannot
apply (no example inputs, no recorded outputs) are reported as skipped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .atomic import manifest_sha256
from .checkpoint import load_checkpoint, reference_outputs
from .forge_graph import ForgeGraph
from .reference_outputs import compare_outputs, run_example
from .targets import CheckpointError

__all__ = ["Check", "VerifyReport", "verify_checkpoint"]


@dataclass(frozen=True)
class Check:
    """One verification step: ``status`` is ok | failed | skipped, ``detail`` says what was seen."""

    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class VerifyReport:
    """All checks of one checkpoint; ``ok`` when none failed."""

    path: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.status != "failed" for c in self.checks)

    def text(self) -> str:
        lines = [f"{c.name:10s} {c.status.upper():8s} {c.detail}" for c in self.checks]
        return "\n".join([*lines, f"{self.path}: {'verified' if self.ok else 'FAILED'}"])


def verify_checkpoint(path: str | Path, atol: float = 1e-5,
                      expected_sha256: str | None = None) -> tuple[VerifyReport, ForgeGraph | None]:
    """Run every check on the checkpoint at ``path``; returns the report and the reloaded graph (None on failure).

    The manifest check reports the manifest's SHA-256: the digest to publish, which users pin with
    ``expected_sha256`` (here, ``from_checkpoint`` or ``fxforge verify --expected-sha256``).
    """
    checks: list[Check] = []
    report = VerifyReport(str(path), checks)
    try:
        digest = expected_sha256 or manifest_sha256(path)  # everything below reads exactly this manifest
        mg = load_checkpoint(path, digest)
    except CheckpointError as exc:
        checks.append(Check("load", "failed", str(exc)))
        return report, None
    nodes = sum(1 for _ in mg.nodes)
    pinned = "matches the expected digest" if expected_sha256 else "pin it with --expected-sha256 / expected_sha256="
    checks.append(Check("manifest", "ok", f"size and SHA-256 of every listed file match; manifest SHA-256 "
                                          f"{digest.lower()} ({pinned})"))
    checks.append(Check("allowlist", "ok", "every target, module class and pytree type is allowlisted"))
    checks.append(Check("reload", "ok", f"{nodes} nodes rebuilt and linted, metadata restored, "
                                        f"{len(mg.history)} passes in history"))
    if mg.example_inputs is None:
        checks.append(Check("run", "skipped", "the checkpoint has no example inputs"))
        checks.append(Check("outputs", "skipped", "nothing to compare without example inputs"))
        return report, mg
    mg.eval()
    try:
        output = run_example(mg)
    except Exception as exc:  # noqa: BLE001 - any failure of the reloaded graph is the finding
        checks.append(Check("run", "failed", f"{type(exc).__name__}: {exc}"))
        return report, mg
    checks.append(Check("run", "ok", "the reloaded graph runs on its example inputs"))
    try:
        recorded = reference_outputs(path, digest)
    except CheckpointError as exc:
        checks.append(Check("outputs", "failed", str(exc)))
        return report, mg
    if recorded is None:
        checks.append(Check("outputs", "skipped", "no reference outputs were recorded at export "
                                                  "(graph in training mode or exported by an older fxforge)"))
        return report, mg
    cmp = compare_outputs(output, recorded, atol)
    detail = cmp.problem or f"{cmp.compared} output tensors, max |diff| {cmp.max_abs_diff:.2e} (atol {atol:g})"
    checks.append(Check("outputs", "ok" if cmp.equal else "failed", detail))
    return report, mg
