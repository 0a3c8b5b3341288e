"""Verify a checkpoint end to end: manifest, allowlist, reload, run, and equality to the recorded outputs.

What each check means: *manifest* -- every listed file has the recorded size and SHA-256 (nothing was
corrupted after export; anyone can re-hash edited files, so the manifest's own SHA-256 is printed: the
digest a publisher shares and users pin with ``expected_sha256``); *allowlist* -- every call target,
module class and pytree type resolves through graph/targets (no pickle, no import, no exec); *reload* --
the graph and metadata rebuild and lint; *run* -- the reloaded graph runs on the checkpoint's example
inputs; *outputs* -- those outputs equal the ones recorded at export within ``atol``. Checks that cannot
apply (no example inputs, no recorded outputs) are reported as skipped, with the reason. The report also
measures the weight file: bytes stored packed, unpacked and in lowered layers (their integer codes, kernel scales
and bias, see ``graph.packed.register_lowered``), beside the ``weight_bits`` accounting, when given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import loads_json, manifest_sha256, read_verified
from .checkpoint import load_checkpoint, reference_outputs
from .checkpoint_load import FORMAT, GRAPH, INPUTS, METADATA, OUTPUTS, READABLE_VERSIONS, WEIGHTS
from .checkpoint_packed import StoredBytes, stored_bytes
from .forge_graph import ForgeGraph
from .reference_outputs import compare_outputs, run_example
from .targets import CheckpointError

__all__ = ["Check", "VerifyReport", "measure_weights", "verify_checkpoint"]


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
    stored: StoredBytes | None = None  # what weights.safetensors holds, once the checkpoint loaded
    accounted_bytes: float | None = None  # the graph's weight_bits / 8, when an accounting was given

    @property
    def ok(self) -> bool:
        return all(c.status != "failed" for c in self.checks)

    def text(self) -> str:
        lines = [f"{c.name:10s} {c.status.upper():8s} {c.detail}" for c in self.checks]
        return "\n".join([*lines, *self.storage_lines(), f"{self.path}: {'verified' if self.ok else 'FAILED'}"])

    def storage_lines(self) -> list[str]:
        """The weight file's measured bytes (packed, unpacked and lowered weights apart) beside the accounted ones."""
        s = self.stored
        if s is None:
            return []
        lowered = (f" + {s.lowered:,} B lowered ({s.lowered_layers} layers: int codes, kernel scales, bias)"
                   if s.lowered_layers else "")
        lines = [f"{'weights':10s} {'':8s} stored {s.weights:,} B = {s.packed:,} B packed ({s.packed_tensors} tensors)"
                 f" + {s.unpacked:,} B unpacked{lowered}; other tensors {s.other:,} B, file header {s.header:,} B"]
        if self.accounted_bytes is not None:
            ratio = s.weights / self.accounted_bytes if self.accounted_bytes else float("nan")
            lines.append(f"{'':10s} {'':8s} accounted weight_bits/8 {self.accounted_bytes:,.0f} B "
                         f"(stored/accounted {ratio:.3f})")
        for name, reason in list(s.unpacked_quantized.items())[:10]:
            lines.append(f"{'':10s} {'':8s} unpacked {name}: {reason}"[:300])
        if len(s.unpacked_quantized) > 10:
            lines.append(f"{'':10s} {'':8s} ... {len(s.unpacked_quantized) - 10} more quantized tensors unpacked")
        return lines


def measure_weights(path: str | Path, expected_sha256: str | None = None) -> StoredBytes:
    """The bytes a checkpoint's weight file stores, packed and unpacked apart (manifest-verified first)."""
    root = Path(path)
    payloads, _ = read_verified(root, FORMAT, READABLE_VERSIONS, (GRAPH, METADATA, WEIGHTS), (INPUTS, OUTPUTS),
                                expected_sha256)
    return stored_bytes(loads_json(payloads[GRAPH], str(root / GRAPH)), payloads[WEIGHTS])


def verify_checkpoint(path: str | Path, atol: float = 1e-5, expected_sha256: str | None = None,
                      weight_bits: Callable[[ForgeGraph], float] | None = None
                      ) -> tuple[VerifyReport, ForgeGraph | None]:
    """Run every check on the checkpoint at ``path``; returns the report and the reloaded graph (None on failure).

    ``weight_bits`` (e.g. ``fxforge.search.objectives.weight_bits``) accounts the reloaded graph's weights,
    reported beside the bytes the checkpoint stores.

    The manifest check reports the manifest's SHA-256: the digest to publish, which users pin with
    ``expected_sha256`` (here, ``from_checkpoint`` or ``fxforge verify --expected-sha256``).
    """
    checks: list[Check] = []
    try:
        digest = expected_sha256 or manifest_sha256(path)  # everything below reads exactly this manifest
        mg = load_checkpoint(path, digest)
        stored = measure_weights(path, digest)
    except CheckpointError as exc:
        checks.append(Check("load", "failed", str(exc)))
        return VerifyReport(str(path), checks), None
    report = VerifyReport(str(path), checks, stored, None if weight_bits is None else weight_bits(mg) / 8)
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
