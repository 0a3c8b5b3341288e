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
Reading is graph/toml_file.py's (size cap, strict UTF-8, regular files only). Paths the file names for
writing (an export step's ``path``, any pass arg its args type lists in ``OUTPUT_PATHS``) resolve under
the caller's output root (graph/output_paths.py): ``..`` and absolute paths only if the caller allows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..graph.output_paths import resolve_output_path
from ..graph.toml_file import MAX_TOML_BYTES, load_toml_file, parse_toml_text
from .steps import PipelineError, pass_spec, resolve_pass

__all__ = ["MAX_TOML_BYTES", "confine_output_paths", "load_toml", "parse_toml"]


def parse_toml(text: str, where: str = "<string>") -> dict[str, Any]:
    """Parse TOML text; PipelineError naming ``where`` and the line of a syntax error."""
    return parse_toml_text(text, where, PipelineError)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read and parse a pipeline TOML file through fxforge's one hardened TOML reader (graph/toml_file.py:
    a regular file of at most MAX_TOML_BYTES, strict UTF-8); PipelineError naming the file otherwise."""
    return load_toml_file(path, "pipeline file", PipelineError)


def confine_output_paths(doc: Any, root: str | Path | None = None, allow_outside: bool = False) -> Any:
    """``doc`` with every output path its steps name resolved under ``root`` (default: the current directory);
    PipelineError naming the step and arg for one that would leave it (unless ``allow_outside``). Anything
    malformed is left as it is for Pipeline.from_dict to refuse."""
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
        return doc
    steps = []
    for i, step in enumerate(doc["steps"], 1):
        args = step.get("args") if isinstance(step, dict) else None
        outputs = _output_args(step.get("pass")) if isinstance(args, dict) else {}
        if outputs and isinstance(args, dict):  # the isinstance is what _output_args was guarded by
            args = {key: str(resolve_output_path(value, root, allow_outside, f"step {i} ({outputs[key]}): {key}",
                                                 PipelineError)) if key in outputs and isinstance(value, str)
                    else value for key, value in args.items()}
            step = {**step, "args": args}
        steps.append(step)
    return {**doc, "steps": steps}


def _output_args(pass_name: Any) -> dict[str, str]:
    """{arg key (aliases too): pass name} for the args of ``pass_name`` that name files it writes (the args
    type's ``OUTPUT_PATHS``); empty for an unknown pass (make_step refuses it)."""
    try:
        name, fn = resolve_pass(pass_name)
    except PipelineError:
        return {}
    args_type = pass_spec(name, fn).args_type
    outputs = getattr(args_type, "OUTPUT_PATHS", ())
    aliases = getattr(args_type, "MASE_ALIASES", {})
    return {key: name for key in (*outputs, *(a for a, f in aliases.items() if f in outputs))}
