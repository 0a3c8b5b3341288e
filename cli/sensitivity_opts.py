"""Where ``fxforge report`` and ``fxforge draw`` get the "sensitivity" overlay's values.

Either measured: ``sensitivity_analysis_pass`` on N calibration batches made from the checkpoint's example
inputs (the example itself, then seeded variants: integer inputs with more than two distinct values, token ids,
redrawn from the values the example holds; 0/1 masks and type ids kept; float inputs with noise of a tenth of
their spread), at one weight width. Or read: a SensitivityInfo JSON (``info.to_json()``, as search studies store
it), checked value by value and against the graph's node names, since the file is input we did not write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import passes
from ..graph.forge_graph import ForgeGraph
from ..graph.inputs import ExampleInputs
from ..passes.analysis.sensitivity_types import METHODS, SensitivityInfo
from .errors import CliError

__all__ = ["METHODS", "calibration_batches", "read_sensitivity", "sensitivity_for"]


def _variant(value: Any, gen: torch.Generator) -> Any:
    """One tensor input redrawn as the module docstring says (anything else returned as it is)."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0 or value.dtype == torch.bool:
        return value
    if value.is_floating_point():
        spread = float(value.float().std()) if value.numel() > 1 else 0.0
        noise = torch.randn(value.shape, generator=gen) * (0.1 * spread)
        return (value.float() + noise).to(value.dtype)
    pool = torch.unique(value)
    if pool.numel() <= 2:
        return value
    return pool[torch.randint(0, pool.numel(), value.shape, generator=gen)].to(value.dtype)


def calibration_batches(example: ExampleInputs, n: int, seed: int = 0) -> list[ExampleInputs]:
    """``n`` batches shaped like ``example``: the example itself first, then seeded variants of it."""
    if n < 1:
        raise CliError(f"--sensitivity-data takes a number of batches >= 1, got {n}")
    gen = torch.Generator().manual_seed(seed)
    out = [example]
    for _ in range(n - 1):
        out.append(ExampleInputs(tuple(_variant(a, gen) for a in example.args),
                                 {k: _variant(v, gen) for k, v in example.kwargs.items()}))
    return out


def read_sensitivity(path: Path, mg: ForgeGraph) -> SensitivityInfo:
    """The SensitivityInfo in the JSON file ``path``, whose layers must all be nodes of ``mg``."""
    try:
        info = SensitivityInfo.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise CliError(f"--sensitivity: {path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CliError(f"--sensitivity: {path} is not a sensitivity_analysis_pass result (info.to_json()): {exc}") \
            from None
    names = {n.name for n in mg.nodes} | {str(n.target) for n in mg.nodes if n.op == "call_module"}
    unknown = [layer.name for layer in info.layers if layer.name not in names]
    if unknown:
        shown = ", ".join(repr(u[:60]) for u in unknown[:5])
        raise CliError(f"--sensitivity: {path} names layers this graph does not have: {shown}"
                       f"{' ...' if len(unknown) > 5 else ''} (measured on another model?)")
    return info


def sensitivity_for(mg: ForgeGraph, data: int | None, path: Path | None, method: str = "sqnr",
                    bits: int = 4) -> SensitivityInfo | None:
    """The sensitivity to show: read from ``path``, or measured on ``data`` batches (None: neither given)."""
    if data is not None and path is not None:
        raise CliError("give --sensitivity-data N (measure) or --sensitivity FILE (read), not both")
    if path is not None:
        return read_sensitivity(path, mg)
    if data is None:
        return None
    if method not in METHODS:
        raise CliError(f"--sensitivity-method must be one of {', '.join(METHODS)}, got {method!r}")
    if mg.example_inputs is None:
        raise CliError("--sensitivity-data needs the checkpoint's example inputs, and this one has none: export the "
                       "graph with example inputs, or give --sensitivity FILE")
    args = {"data": calibration_batches(mg.example_inputs, data), "method": method, "widths": (bits,),
            "prune_ratios": ()}
    _, info = passes.sensitivity_analysis_pass(mg, args)
    return info
