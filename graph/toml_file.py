"""The one TOML reader for files a user hands fxforge (pipelines, search configs, the CLI): hostile input.

The file must be a regular file (not a directory, FIFO or device: a FIFO would block the read) of at most
``MAX_TOML_BYTES``, strict UTF-8; every refusal is one message naming the file, and a syntax error also
names its line. Callers pass their own error type so each layer keeps its exceptions.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["MAX_TOML_BYTES", "TomlFileError", "load_toml_file", "parse_toml_text"]

MAX_TOML_BYTES = 1 << 20


class TomlFileError(ValueError):
    """A TOML file fxforge cannot use; the message names the file and what is wrong."""


def parse_toml_text(text: str, where: str = "<string>", error: type[Exception] = TomlFileError) -> dict[str, Any]:
    """Parse TOML text; ``error`` naming ``where`` and the line of a syntax error."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = getattr(exc, "lineno", None) or (int(found.group(1)) if found else None)
        at = f"line {line}: " if line is not None else ""
        raise error(f"{where}: TOML syntax error at {at}{exc}") from None


def load_toml_file(path: str | Path, what: str = "TOML file", error: type[Exception] = TomlFileError,
                   max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """Read and parse the TOML file at ``path`` (``what`` names it in messages, e.g. "search config");
    ``error`` for a missing or unreadable file, a non-regular file, more than ``max_bytes``, bytes that
    are not UTF-8, or a syntax error."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a {what}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file, so not a {what}")
        if info.st_size > max_bytes:
            raise error(f"{path}: {info.st_size} bytes is larger than the {max_bytes} allowed for a {what}")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew after the size check
        raise error(f"{path}: larger than the {max_bytes} bytes allowed for a {what}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_toml_text(text, str(path), error)
