"""Where a deploy artifact goes: ``OUT`` is validated before any work, written as a temporary sibling and moved
into place, so readers never see half an artifact and nothing but a previous deploy directory is replaced.

``OUT`` may be a new path (parents are created), an empty directory, or a deploy directory holding only what an
export writes (``deploy.json`` and the artifact). An existing file, a symlink, a directory with anything else in
it (never deleted) or a path under a non-directory is refused with a DeployError naming the path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .manifest import ARTIFACT_FILES, MANIFEST_NAME, DeployError, is_deploy_dir

__all__ = ["DEPLOY_FILES", "check_output_dir", "StagedDir"]

# Every name an export writes (ONNX external weights sit beside the model as model.onnx.data).
DEPLOY_FILES = frozenset({MANIFEST_NAME, *ARTIFACT_FILES.values(), ARTIFACT_FILES["onnx"] + ".data"})


def check_output_dir(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir`` as an absolute path if a deploy may be written there; DeployError naming it otherwise."""
    out = Path(os.path.abspath(out_dir))
    for parent in reversed(out.parents):
        if parent.is_symlink() and parent.resolve().is_dir():
            continue
        if parent.exists() and not parent.is_dir():
            raise DeployError(f"deploy output {out}: {parent} is a file, not a directory; choose a path under a "
                              "directory")
    if out.is_symlink():
        raise DeployError(f"deploy output {out} is a symlink; give the real directory (a symlink is never replaced)")
    if out.exists() and not out.is_dir():
        raise DeployError(f"deploy output {out} is an existing file; choose a new or empty directory, or a previous "
                          "deploy directory to replace")
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        others = [e for e in entries if e not in DEPLOY_FILES or not (out / e).is_file() or (out / e).is_symlink()]
        if entries and (others or not is_deploy_dir(out)):
            shown = ", ".join((others or entries)[:5])
            raise DeployError(f"deploy output {out} is a non-empty directory that is not a deploy directory (it holds "
                              f"{shown}); it is never deleted: choose a new or empty directory")
    return out


class StagedDir:
    """A temporary sibling of ``out`` to write the artifact into; :meth:`commit` moves it into place (replacing
    a previous deploy directory only, re-checked at that moment), :meth:`discard` removes it."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out = check_output_dir(out_dir)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.deploy-", dir=self.out.parent))
        except OSError as exc:
            raise DeployError(f"deploy output {self.out}: cannot create a directory beside it ({exc})") from exc

    def commit(self) -> Path:
        """Move the staged directory to ``out``; the previous deploy directory there (if any) is removed."""
        check_output_dir(self.out)
        old: Path | None = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, old / "previous")
        try:
            os.replace(self.path, self.out)
        except OSError as exc:
            if old is not None:
                os.replace(old / "previous", self.out)
                shutil.rmtree(old, ignore_errors=True)
            raise DeployError(f"deploy output {self.out}: could not move the artifact into place ({exc})") from exc
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
