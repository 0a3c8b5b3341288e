"""The CLI's error type and how any failure becomes one line on stderr and a non-zero exit code."""

from __future__ import annotations

import tomllib

from ..graph.targets import CheckpointError
from ..models.zoo import UnknownModelError

__all__ = ["EXPECTED", "CliError", "one_line"]


class CliError(Exception):
    """Bad input to a command (missing file, bad TOML, feature not in this build); the message is for the user."""


# Failures caused by what the user gave: the message alone is the answer (no exception type shown).
EXPECTED: tuple[type[BaseException], ...] = (CliError, CheckpointError, UnknownModelError, FileNotFoundError,
                                             tomllib.TOMLDecodeError, ValueError)


def one_line(exc: BaseException) -> str:
    """The exception as one line: its message with newlines folded; the type too when it was not expected."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__
    if len(text) > 400:
        text = text[:399] + "…"
    if isinstance(exc, EXPECTED):
        return text
    return f"{type(exc).__name__}: {text} (run with --debug for the traceback)"
