"""The one TOML reader for files a user hands fxforge (pipelines, search configs, the CLI): hostile input.

The file must be a regular file (not a directory, FIFO or device: a FIFO would block the read) of at most
``MAX_TOML_BYTES``, strict UTF-8, nested at most ``MAX_TOML_DEPTH`` deep; every refusal is one message naming
the file, and a syntax error also names its line. Callers pass their own error type so each layer keeps its
exceptions. The nesting is measured by one linear scan before tomllib runs: tomllib recurses once per ``[``
or ``{`` (RecursionError at ~400) and is quadratic in the parts of a dotted key (3,000 parts: 0.3 s, 12,000: 5 s).
:func:`read_user_file` is the same hardened read for other files (e.g. search results JSON).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["MAX_TOML_BYTES", "MAX_TOML_DEPTH", "TomlFileError", "load_toml_file", "parse_toml_text", "read_user_file",
           "toml_depth"]

MAX_TOML_BYTES = 1 << 20
MAX_TOML_DEPTH = 32  # tables, arrays and dotted-key parts nested; real configs use fewer than 10

# The scan's tokens; a string's rest is matched once from its opening quote (alternatives that cannot both
# match at one character, so a failed match backtracks once over it): the whole scan is linear.
_TOKENS = re.compile(r'"""|\'\'\'|["\'#\[\]{}=,.\n]')
_LITERAL = re.compile(r"[^'\n]*'")  # the rest of a one-line 'literal string'
_BASIC = re.compile(r'(?:[^"\\\n]|\\.)*"')  # the rest of a one-line "string" (escapes skipped)
_BASIC_ML = re.compile(r'(?:[^"\\]|\\.|"(?!""))*"""', re.DOTALL)  # the rest of a """multi-line""" string


class TomlFileError(ValueError):
    """A TOML file fxforge cannot use; the message names the file and what is wrong."""


def toml_depth(text: str, limit: int = MAX_TOML_DEPTH) -> int:
    """The deepest nesting of ``[``/``{`` plus dotted-key parts, outside strings and comments, in one linear
    scan that stops past ``limit`` (an unterminated string ends it: tomllib then reports the syntax error)."""
    deepest = depth = dots = 0
    pos = 0
    while deepest <= limit and (m := _TOKENS.search(text, pos)) is not None:
        tok, pos = m.group(), m.end()
        if tok in ('"', '"""'):
            end = (_BASIC if tok == '"' else _BASIC_ML).match(text, pos)
            if end is None:
                break
            pos = end.end()
        elif tok == "'":
            end = _LITERAL.match(text, pos)
            if end is None:
                break
            pos = end.end()
        elif tok == "'''":
            close = text.find(tok, pos)
            if close < 0:
                break
            pos = close + 3
        elif tok == "#":
            close = text.find("\n", pos)
            pos = len(text) if close < 0 else close
        elif tok == ".":
            dots += 1
            deepest = max(deepest, depth + dots)
        else:  # a bracket, '=', ',' or a newline ends a dotted key
            dots = 0
            depth += 1 if tok in "[{" else -1 if tok in "]}" else 0
            deepest = max(deepest, depth)
    return deepest


def _nesting(doc: Any, where: str, error: type[Exception]) -> None:
    """Refuse a parsed document nested deeper than MAX_TOML_DEPTH (dotted keys and tables add up)."""
    stack: list[tuple[Any, int, str]] = [(doc, 0, "")]
    while stack:
        value, depth, key = stack.pop()
        if depth > MAX_TOML_DEPTH:
            raise error(f"{where}: TOML nested more than {MAX_TOML_DEPTH} deep (at {key[:80]}...)")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((v, depth + 1, f"{key}.{k}" if key else str(k)) for k, v in items)


def parse_toml_text(text: str, where: str = "<string>", error: type[Exception] = TomlFileError) -> dict[str, Any]:
    """Parse TOML text nested at most MAX_TOML_DEPTH deep; ``error`` naming ``where`` (and the line of a
    syntax error)."""
    deepest = toml_depth(text)
    if deepest > MAX_TOML_DEPTH:
        raise error(f"{where}: TOML nested more than {MAX_TOML_DEPTH} deep (tables, arrays or dotted-key parts; "
                    f"at most {MAX_TOML_DEPTH} allowed)")
    try:
        doc = tomllib.loads(text)
    except RecursionError:  # not reached after the scan above; kept so no input escapes as a raw error
        raise error(f"{where}: TOML nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = getattr(exc, "lineno", None) or (int(found.group(1)) if found else None)
        at = f"line {line}: " if line is not None else ""
        raise error(f"{where}: TOML syntax error at {at}{exc}") from None
    _nesting(doc, where, error)
    return doc


def read_user_file(path: str | Path, what: str, error: type[Exception], max_bytes: int) -> str:
    """The text of a file a user gave: a regular file (no directory, FIFO or device) of at most ``max_bytes``,
    strict UTF-8; ``error`` naming the file (``what`` names its kind, e.g. "search config") otherwise."""
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
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_toml_file(path: str | Path, what: str = "TOML file", error: type[Exception] = TomlFileError,
                   max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """Read and parse the TOML file at ``path`` (``what`` names it in messages, e.g. "search config");
    ``error`` for a missing or unreadable file, a non-regular file, more than ``max_bytes``, bytes that
    are not UTF-8, nesting beyond MAX_TOML_DEPTH, or a syntax error."""
    return parse_toml_text(read_user_file(path, what, error, max_bytes), str(path), error)
