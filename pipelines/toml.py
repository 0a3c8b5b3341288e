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
Reading is graph/toml_file.py's (size cap, strict UTF-8, regular files only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..graph.toml_file import MAX_TOML_BYTES, load_toml_file, parse_toml_text
from .steps import PipelineError

__all__ = ["MAX_TOML_BYTES", "load_toml", "parse_toml"]


def parse_toml(text: str, where: str = "<string>") -> dict[str, Any]:
    """Parse TOML text; PipelineError naming ``where`` and the line of a syntax error."""
    return parse_toml_text(text, where, PipelineError)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read and parse a pipeline TOML file through fxforge's one hardened TOML reader (graph/toml_file.py:
    a regular file of at most MAX_TOML_BYTES, strict UTF-8); PipelineError naming the file otherwise."""
    return load_toml_file(path, "pipeline file", PipelineError)
