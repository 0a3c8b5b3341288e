"""Which axes of each node's value index the sequence positions of one input (the time axes).

The graph runs once on fake tensors whose sizes are symbols (a ShapeEnv without duck sizing, so two
dims of equal size stay distinct symbols). A node's time axes are the dims whose size is exactly the
input's time symbol: the axis is followed through transposes, permutes, reshapes and slices by torch's
own shape rules, never guessed from a size (a (B, C, T) tensor with C == T has one time axis, the last).
A dim of size ``2*T`` (a padded FFT) or ``B*T`` (a flattened batch) is not a time axis.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

__all__ = ["TimeAxisError", "time_axes"]


class TimeAxisError(ValueError):
    """The time axis cannot be followed through some node (it cannot run on symbolic sizes, or fixes the length)."""


def _axes(value: Any, env: ShapeEnv, time: sympy.Expr) -> tuple[int, ...]:
    if not isinstance(value, torch.Tensor):
        return ()
    return tuple(d for d, s in enumerate(value.shape)
                 if isinstance(s, torch.SymInt) and env.simplify(s.node.expr) == time)


class _SymbolicRun(fx.Interpreter):
    """Runs the graph on symbolic fake tensors, recording each node's time axes as it goes (a later guard
    may fix the length, after which sizes no longer tell which axis is time)."""

    def __init__(self, gm: fx.GraphModule, env: ShapeEnv, time_size: torch.SymInt, name: str) -> None:
        super().__init__(gm)
        self.shape_env, self.time_size, self.input_name = env, time_size, name
        self.axes: dict[fx.Node, tuple[int, ...]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A linear layer whose kernel has no fake implementation (the int8-lowered onednn one) maps the last
        axis only: its output is a stand-in of the input's leading (symbolic) dims and ``out_features``."""
        try:
            return super().call_module(target, args, kwargs)
        except Exception:
            module = self.module.get_submodule(str(target))
            x = args[0] if args else None
            out_features = getattr(module, "out_features", None)
            if getattr(module, "fxforge_op", None) != "linear" or not isinstance(x, torch.Tensor) \
                    or not isinstance(out_features, int):
                raise
            return x.new_empty((*x.shape[:-1], out_features))

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as exc:  # any failure of an op on fake/symbolic sizes
            raise TimeAxisError(f"cannot follow the time axis of {self.input_name!r} through node {n.name!r} "
                                f"({n.op} {n.target}): {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        time = self.shape_env.simplify(self.time_size.node.expr)
        if not time.free_symbols:
            raise TimeAxisError(f"node {n.name!r} ({n.op} {n.target}) fixes the length of {self.input_name!r}'s "
                                f"time axis at {time}: the time axis cannot be followed past it (capture the "
                                "model so that the sequence length is not a constant)")
        self.axes[n] = _axes(out, self.shape_env, time)
        return out


def time_axes(gm: fx.GraphModule, flat: list[Any], which: int, seq_dim: int,
              name: str = "input") -> dict[fx.Node, tuple[int, ...]]:
    """Every node's time axes (placeholders included) for axis ``seq_dim`` of flat input ``which``.

    Other inputs get their own symbols; where the graph combines them with the time axis (an attention
    mask of the same length) the shape environment unifies the two, so their axes count as time too.
    """
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes: list[Any] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            dynamic = [DimDynamic.DYNAMIC] * value.dim()
            context: StatelessSymbolicContext[..., Any] = StatelessSymbolicContext(dynamic_sizes=dynamic)
            fakes.append(mode.from_tensor(value, symbolic_context=context))
        else:
            fakes.append(value)
    time_size = fakes[which].shape[seq_dim]
    if not isinstance(time_size, torch.SymInt):  # the shape environment keeps sizes 0 and 1 constant
        raise TimeAxisError(f"axis {seq_dim} of {name!r} has length {time_size}: give an input with a longer "
                            "time axis to follow it")
    run = _SymbolicRun(gm, env, time_size, name)
    with mode, enable_python_dispatcher():  # decompositions that take symbolic sizes (an FFT's n)
        run.run(*fakes)
    # an input combined with the time axis only after it was recorded (a mask) is unified by now
    time = env.simplify(time_size.node.expr)
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], fakes, strict=False):
        run.axes[node] = _axes(value, env, time)
    return run.axes
