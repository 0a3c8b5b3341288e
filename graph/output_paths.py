"""Where a path named by a file (a pipeline's export step, a search's run_dir) may write: under an output root.

A pipeline or search file is hostile input: ``path = "../../../x"`` or an absolute path would create parents
and replace a checkpoint anywhere the user can write. Paths from a file are therefore relative, without
``..``, not the root itself, and resolve under the output root the caller gives (default: the current
directory); a symbolic link inside the root that leads out is refused too. The caller, not the file, can lift
the rule (``allow_outside_root=True`` in Python, ``--allow-outside-root`` on the command line).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["resolve_output_path"]


def resolve_output_path(value: str, root: str | Path | None, allow_outside: bool, field: str,
                        error: type[Exception]) -> Path:
    """``value`` (a path a file named, as ``field``) resolved under ``root``; ``error`` naming the field when
    it would leave the root, unless ``allow_outside``."""
    base = Path.cwd() if root is None else Path(root)
    path = Path(value)
    if allow_outside:
        return path if path.is_absolute() else base / path
    hint = "(the caller may allow it: allow_outside_root=True, or --allow-outside-root on the command line)"
    if path.is_absolute() or ".." in path.parts or not path.parts:
        why = "is absolute" if path.is_absolute() else "goes up with '..'" if path.parts else "names the root itself"
        raise error(f"{field} = {value!r} {why}: paths from a file must stay under the output root {base} {hint}")
    full = base / path
    real_root, real = base.resolve(), full.resolve()
    if not real.is_relative_to(real_root):
        raise error(f"{field} = {value!r} resolves through a symbolic link to {real}, outside the output root "
                    f"{base} {hint}")
    return full
