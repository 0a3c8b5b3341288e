"""The one JSON conversion: metadata records, pass infos, history args and calibration statistics.

``jsonable(value)`` summarises what JSON cannot hold (tensors by shape and dtype, classes by name);
``strict=True`` refuses it instead (metadata records must round-trip); ``tensor_values=True`` writes
a tensor's numbers (a float, or a flat list). Non-finite floats become their repr ("inf", "nan").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["jsonable"]


def jsonable(value: Any, *, strict: bool = False, tensor_values: bool = False) -> Any:
    """A JSON view of ``value`` (see the module docstring)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, tuple | list | set | frozenset) and not (strict and isinstance(value, set | frozenset)):
        return [jsonable(v, strict=strict, tensor_values=tensor_values) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, strict=strict, tensor_values=tensor_values) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and tensor_values:
        t = value.detach().float().cpu()
        return jsonable(float(t)) if t.dim() == 0 else [jsonable(float(v)) for v in t.reshape(-1)]
    if strict:
        raise TypeError(f"metadata value of type {type(value).__name__} is not JSON-serialisable")
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: jsonable(getattr(value, f.name), tensor_values=tensor_values) for f in fields}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"<{type(value).__name__}>"
