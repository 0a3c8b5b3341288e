"""Write a DOT drawing as text, or rendered by Graphviz's ``dot`` (Debian's ``graphviz`` package).

The output file's suffix picks the form: ``.dot`` / ``.gv`` the DOT text itself (no Graphviz needed), ``.svg``,
``.png`` or ``.pdf`` rendered by ``dot``. Without ``dot`` on PATH the error says how to install it; fxforge
never installs system packages itself.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["FORMATS", "GraphvizMissingError", "dot_executable", "write_dot"]

FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}
TEXT = (".dot", ".gv")
TIMEOUT_S = 300


class GraphvizMissingError(RuntimeError):
    """Graphviz's ``dot`` is not installed; the message says how to install it or get the DOT text instead."""


def dot_executable() -> str:
    """The path of Graphviz's ``dot`` (GraphvizMissingError when it is not on PATH)."""
    found = shutil.which("dot")
    if found is None:
        raise GraphvizMissingError("rendering needs Graphviz's `dot`, which is not installed: apt-get install graphviz "
                                   "(Debian / Ubuntu; brew install graphviz on macOS), or write the DOT text "
                                   "itself with -o FILE.dot")
    return found


def write_dot(dot_text: str, path: str | Path) -> Path:
    """Write ``dot_text`` to ``path`` as text (``.dot``, ``.gv``) or rendered by ``dot`` (``.svg``, ``.png``,
    ``.pdf``); parents created; ValueError for another suffix, RuntimeError naming dot's own error."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TEXT and suffix not in FORMATS:
        raise ValueError(f"{path}: the drawing's suffix must be one of {', '.join([*TEXT, *FORMATS])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in TEXT:
        path.write_text(dot_text, encoding="utf-8")
        return path
    proc = subprocess.run([dot_executable(), f"-T{FORMATS[suffix]}", "-o", str(path)], input=dot_text.encode(),
                          capture_output=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"dot failed to render {path} (exit {proc.returncode}): {err[-300:]}")
    return path
