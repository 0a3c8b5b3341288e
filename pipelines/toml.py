"""Reading a pipeline from a TOML file (Python's tomllib); the file is hostile input.

    name = "int8"
    verify = true

    [[steps]]
    pass = "remove_dropout_transform_pass"

    [[steps]]
    pass = "quantize_transform_pass"
    contract = { min_sqnr_db = 20.0 }
    [steps.args]
    by = "type"

A syntax error names the file and the line; the document's shape is checked by Pipeline.from_dict.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from .steps import PipelineError

__all__ = ["MAX_TOML_BYTES", "load_toml", "parse_toml"]

MAX_TOML_BYTES = 1 << 20


def parse_toml(text: str, where: str = "<string>") -> dict[str, Any]:
    """Parse TOML text; PipelineError naming ``where`` and the line of a syntax error."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = getattr(exc, "lineno", None) or (int(found.group(1)) if found else None)
        at = f"line {line}: " if line is not None else ""
        raise PipelineError(f"{where}: TOML syntax error at {at}{exc}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read and parse a pipeline TOML file (at most MAX_TOML_BYTES, UTF-8)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_TOML_BYTES:
            raise PipelineError(f"{path}: {size} bytes is larger than the {MAX_TOML_BYTES} allowed for a pipeline file")
        with path.open("rb") as fh:
            data = fh.read(MAX_TOML_BYTES + 1)
    except OSError as exc:
        raise PipelineError(f"{path}: cannot read the pipeline file ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return parse_toml(text, str(path))
