"""Outputs recorded at export time so ``fxforge verify`` can prove a reloaded checkpoint computes the same.

At export, a graph in eval mode that has example inputs is run once on them; its tensor outputs (the
pytree leaves, by position) are stored in the checkpoint. A graph in training mode records nothing
(dropout would make the outputs random), nor does one whose forward fails on its own example inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from .forge_graph import ForgeGraph

__all__ = ["OutputComparison", "compare_outputs", "outputs_of", "run_example"]


def run_example(mg: ForgeGraph) -> Any:
    """``mg`` called on its example inputs without gradients (ValueError when it has none)."""
    ex = mg.example_inputs
    if ex is None:
        raise ValueError("the graph has no example inputs")
    with torch.no_grad():
        return mg.model(*ex.args, **ex.kwargs)


def _leaves(output: Any) -> dict[str, torch.Tensor]:
    leaves, _ = pytree.tree_flatten(output)
    return {f"out{i}": t.detach().cpu().contiguous() for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}


def outputs_of(mg: ForgeGraph) -> dict[str, torch.Tensor] | None:
    """The tensors to record for ``mg``, or None when its outputs are not reproducible or it cannot run."""
    if mg.example_inputs is None or any(m.training for m in mg.model.modules()):
        return None
    try:
        leaves = _leaves(run_example(mg))
    except Exception:  # noqa: BLE001 - recording is best effort; the checkpoint is valid without it
        return None
    return leaves or None


@dataclass(frozen=True)
class OutputComparison:
    """How a run compares with recorded outputs: equal within ``atol``, and the largest difference."""

    equal: bool
    max_abs_diff: float
    compared: int
    problem: str = ""


def compare_outputs(output: Any, recorded: dict[str, torch.Tensor], atol: float = 1e-5) -> OutputComparison:
    """Compare a run's outputs with recorded ones leaf by leaf (names, shapes, dtypes, values within atol)."""
    got = _leaves(output)
    if set(got) != set(recorded):
        return OutputComparison(False, float("inf"), 0, f"output leaves {sorted(got)} != recorded {sorted(recorded)}")
    worst = 0.0
    for name, ref in recorded.items():
        out = got[name]
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return OutputComparison(False, float("inf"), 0, f"{name}: {tuple(out.shape)} {out.dtype} != recorded "
                                                            f"{tuple(ref.shape)} {ref.dtype}")
        if out.numel():
            diff = (out.double() - ref.double()).abs().max().item() if out.is_floating_point() or out.is_complex() \
                else float((out != ref).any().item())
            worst = max(worst, diff)
    return OutputComparison(worst <= atol, worst, len(recorded))
