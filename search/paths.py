"""Files a search will write (its study storage, its results JSON), checked before any trial runs, so a
path that cannot be written is refused at once instead of after the whole search."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SearchError

__all__ = ["check_writable_file"]


def check_writable_file(path: str | Path, what: str) -> Path:
    """``path`` if a file can be written there (creating missing parent directories): refuses, naming
    ``what``, a directory, a read-only file, or a path whose nearest existing parent is a file or a
    directory that is not writable. Nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise SearchError(f"{what} {str(path)!r} is a directory; give a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise SearchError(f"{what} {str(path)!r} is not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise SearchError(f"{what} {str(path)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SearchError(f"{what} {str(path)!r}: directory {str(parent)!r} is not writable")
    return path
