"""Example inputs of a captured graph: positional args plus keyword args, in one typed value."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ExampleInputs:
    """What the model is called with: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def coerce(cls, value: Any) -> ExampleInputs:
        """Accept a tensor, a tuple/list of args, a dict of kwargs, or an ExampleInputs."""
        if isinstance(value, ExampleInputs):
            return value
        if isinstance(value, torch.Tensor):
            return cls(args=(value,))
        if isinstance(value, tuple | list):
            return cls(args=tuple(value))
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise TypeError(f"example input keys must be str, got {bad}")
            return cls(kwargs=dict(value))
        raise TypeError(
            f"example_inputs must be a tensor, a tuple/list of args or a dict of kwargs, not {type(value).__name__}"
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name → tensor view (``args.0``, ``kwargs.input_ids``) for saving."""
        out = {f"args.{i}": v for i, v in enumerate(self.args) if isinstance(v, torch.Tensor)}
        out.update({f"kwargs.{k}": v for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ExampleInputs:
        """Inverse of :meth:`tensors` (tensor-only inputs)."""
        args = sorted(((int(k.split(".", 1)[1]), v) for k, v in tensors.items() if k.startswith("args.")))
        kwargs = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("kwargs.")}
        return cls(args=tuple(v for _, v in args), kwargs=kwargs)
