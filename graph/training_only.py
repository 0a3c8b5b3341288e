"""Training-only regions: modules whose train-mode forward is random in a way no switch restores (stochastic
depth, LayerDrop, SpecAugment) or cannot be traced at all; capture takes them in eval semantics.

Capture traces in train mode so dropout stays switchable (graph/dropout_tracing, graph/normalize). Any other
random op would be baked into the eval graph. A node is random when its ATen op is tagged
``nondeterministic_seeded`` (for fx: the ATen op of the torch function's or method's name), unless it is
given ``train=False``. Only when the normalised train-mode graph has some, an eval-mode trace is compared:
the innermost modules owning more random ops in train mode than in eval mode are training-only (the rest is
the model's eval semantics, kept). Those modules' *own* ``training`` flag is turned off (children such as
``nn.Dropout`` stay in train mode) and the model re-traced, until none is left. A train-mode trace that fails
does the same with the failing module (its training branch is untraceable, e.g. wav2vec2's SpecAugment and
LayerDrop); if that does not converge, the whole model is traced in eval mode with its dropout modules in
train mode. Every flag is restored afterwards. The graph then carries a refusal (graph/training_guard).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .normalize import innermost_module

__all__ = ["is_random", "random_owners", "train_mode_capture", "TrainingCaptureError", "MAX_MODULES",
           "MAX_ROUNDS", "rng_kept", "eval_outputs", "output_difference", "differs_cause", "eval_mode_capture"]

MAX_MODULES = 6  # failing modules taken in eval semantics before falling back to an eval-mode capture
MAX_ROUNDS = 3  # re-traces for random ops (each takes every module left with training-only ones)
_TRAIN_ARGS = ("train", "training")
T = TypeVar("T")


def _packet_random(name: str) -> torch._ops.OpOverloadPacket | None:
    """The ATen op packet of that name when one of its overloads is ``nondeterministic_seeded``."""
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return packet if any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads) else None


def _told_not_to_train(node: fx.Node, schema: torch.FunctionSchema) -> bool:
    """Whether the call passes ``train=False``/``training=False`` (dropout in eval mode: not random)."""
    for i, arg in enumerate(schema.arguments):
        if arg.name in _TRAIN_ARGS:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, node.kwargs.get("training"))
            return value is False
    return False


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (an ATen op, torch function or Tensor method tagged
    ``nondeterministic_seeded``, not called with ``train=False``)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        op = node.target
        return torch.Tag.nondeterministic_seeded in op.tags and not _told_not_to_train(node, op._schema)
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function" and callable(node.target):
        name = getattr(node.target, "__name__", "")
    else:
        return False
    packet = _packet_random(name)
    if packet is None:
        return False
    schema = getattr(packet, packet.overloads()[0])._schema
    return not _told_not_to_train(node, schema)


def _owner(node: fx.Node) -> str:
    """Path of the innermost module whose forward produced ``node`` ("" for the root's own forward)."""
    site = innermost_module(node)
    return site[0] if site else ""


def random_owners(gm: fx.GraphModule) -> Counter[str]:
    """How many random nodes each module (innermost owner) has in ``gm``."""
    return Counter(_owner(n) for n in gm.graph.nodes if is_random(n))


@contextmanager
def _own_flags_off(model: nn.Module, paths: list[str]) -> Iterator[None]:
    """Turn off the ``training`` flag of exactly these modules (not their children); restore it after."""
    modules = [model.get_submodule(p) for p in paths]
    saved = [m.training for m in modules]
    try:
        for m in modules:
            m.training = False
        yield
    finally:
        for m, flag in zip(modules, saved):
            m.training = flag


def _resolves(model: nn.Module, path: str) -> bool:
    """Whether ``path`` (from a node's nn_module_stack) names a submodule of ``model``."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _is_dropout(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.dropout._DropoutNd)


@contextmanager
def _eval_mode(model: nn.Module, keep_dropout: bool) -> Iterator[None]:
    """The whole model in eval mode (``keep_dropout``: its dropout modules stay in train mode); flags restored."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        if keep_dropout:
            for m in model.modules():
                if _is_dropout(m):
                    m.training = True
        yield
    finally:
        for m, flag in saved:
            m.training = flag


class TrainingCaptureError(RuntimeError):
    """The train-mode trace failed in training-only branches and the eval-mode capture failed otherwise: the
    eval-mode failure (``eval_error``, also the ``__cause__``) is the one to fix."""

    def __init__(self, message: str, eval_error: BaseException) -> None:
        super().__init__(message)
        self.eval_error = eval_error


@dataclass
class EvalSemantics:
    """What capture took in eval semantics: module path -> cause; ``whole_model``: the eval-mode fallback."""

    causes: dict[str, str] = field(default_factory=dict)
    whole_model: bool = False
    remarks: list[str] = field(default_factory=list)  # capture notes that are not eval semantics

    def labelled(self, model: nn.Module) -> dict[str, str]:
        """Module path -> "path (Class): cause", the whole model under "" when it fell back to eval mode."""
        out = {path: f"{path or '<root>'} ({type(model.get_submodule(path)).__name__}): {why}"
               for path, why in self.causes.items()}
        if self.whole_model:
            out.setdefault("", f"<root> ({type(model).__name__}): the train-mode trace could not be freed of "
                               "training-only behaviour module by module, so the whole model was captured in eval "
                               "mode (its dropout modules stay switchable; dropout it applies by other means, e.g. "
                               "SDPA's dropout_p, is off)")
        return out

    def notes(self, model: nn.Module) -> list[str]:
        out = [f"captured {cause}" for cause in self.labelled(model).values()]
        if out:
            out.append("in eval semantics: train mode refuses to run this graph (fxforge.graph.training_guard)")
        return out + self.remarks


Site = Callable[[BaseException], tuple[str | None, str]]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) < 300 else text[:300] + " ..."


def _random_ops(gm: fx.GraphModule, owner: str) -> str:
    ops = sorted({str(n.target) for n in gm.graph.nodes if is_random(n) and _owner(n) == owner})
    return ", ".join(ops[:3]) + (" ..." if len(ops) > 3 else "")


def train_mode_capture(model: nn.Module, attempt: Callable[[], tuple[fx.GraphModule, T]], site: Site,
                       retry_failures: bool = True) -> tuple[fx.GraphModule, T, EvalSemantics]:
    """Run ``attempt`` (trace + normalise ``model``, in train mode) until no training-only region is left
    (see the module docstring). ``site(exc)``: (path of the module a failure happened in or None, where).
    A failing trace is raised as it is unless ``retry_failures``; then the first train-mode error is raised
    when the eval-mode capture fails the same way at the same site (the failure is not about training),
    :class:`TrainingCaptureError` when it fails otherwise."""
    taken = EvalSemantics()
    first: BaseException | None = None
    eval_counts: Counter[str] | None = None
    failed = rounds = 0
    for _ in range(MAX_MODULES + MAX_ROUNDS + 1):
        try:
            with _own_flags_off(model, list(taken.causes)):
                gm, extra = attempt()
        except Exception as exc:  # noqa: BLE001 - retried with the failing module in eval semantics
            if not retry_failures:
                raise
            first = first or exc
            path, where = site(exc)
            if path is None or path in taken.causes or failed >= MAX_MODULES:
                break
            failed += 1
            taken.causes[path] = f"its training branch could not be traced ({_short(exc)}{where})"
            continue
        counts = random_owners(gm)
        if not counts:
            return gm, extra, taken
        if eval_counts is None:
            try:
                with _eval_mode(model, keep_dropout=False):
                    eval_counts = random_owners(attempt()[0])
            except Exception as exc:  # noqa: BLE001 - cannot tell training-only from eval randomness: keep all
                taken.remarks.append(f"random ops of {sorted(counts)} kept as they are: the eval-mode trace that "
                                     f"tells training-only ones apart failed ({_short(exc)})")
                return gm, extra, taken
        excess = [o for o, c in counts.items() if c > eval_counts.get(o, 0)]
        if not excess:
            return gm, extra, taken
        new = [o for o in excess if o not in taken.causes]
        if not new or not all(_resolves(model, o) for o in new) or rounds >= MAX_ROUNDS:
            break
        rounds += 1
        for owner in new:
            taken.causes[owner] = f"random ops only in train mode ({_random_ops(gm, owner)})"
    taken.whole_model = True
    try:
        with _eval_mode(model, keep_dropout=True):
            gm, extra = attempt()
    except Exception as exc:
        if first is None or (site(exc), _short(exc)) == (site(first), _short(first)):
            raise (first or exc) from None  # not about training: the train-mode error as it was
        path, where = site(first)
        raise TrainingCaptureError(
            f"{_short(exc)} (in eval mode; in train mode it failed first in {path or '<root>'}{where}, and taking "
            f"{[p or '<root>' for p in taken.causes]} in eval semantics did not get past it)", exc) from exc
    return gm, extra, taken


# --- The train-mode capture checked against eager in eval mode --------------------------------------------------
# Random choices made outside torch (numpy: graph constants) and outputs that depend on ``self.training`` are
# invisible to the random-op detector; running both once at the example inputs shows them.


@contextmanager
def rng_kept() -> Iterator[None]:
    """torch's and numpy's global random streams as they were before (capture must not advance the user's)."""
    torch_state = torch.random.get_rng_state()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np = None  # type: ignore[assignment]
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.random.set_rng_state(torch_state)
        if np is not None:
            np.random.set_state(np_state)


def eval_outputs(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """``module``'s outputs in eval mode under no_grad, its flags and the random streams left as they were."""
    with rng_kept(), _eval_mode(module, keep_dropout=False), torch.no_grad():
        return module(*args, **kwargs)


def _keys(x: object) -> list[str]:
    return [str(k) for k in x.keys()] if isinstance(x, Mapping) else []


def output_difference(want: object, got: object) -> str | None:
    """How ``got`` differs from ``want`` (None: same structure, every tensor equal bit for bit; NaN equals NaN)."""
    want_leaves, want_spec = pytree.tree_flatten(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if want_spec != got_spec:
        missing = [k for k in _keys(want) if k not in _keys(got)]
        extra = [k for k in _keys(got) if k not in _keys(want)]
        if missing or extra:
            return ", ".join(([f"outputs {','.join(missing)} missing"] if missing else []) +
                             ([f"outputs {','.join(extra)} extra"] if extra else []))
        return f"output structure {got_spec} instead of {want_spec}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(want_leaves, got_leaves)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a != b:
                return f"output {i} is {b!r} instead of {a!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} has {b.dtype}{list(b.shape)} instead of {a.dtype}{list(a.shape)}"
        same = a == b
        if a.is_floating_point() or a.is_complex():
            same |= a.isnan() & b.isnan()
        if not bool(same.all()):
            worst = max(worst, float((a.double() - b.double()).abs().nan_to_num(float("inf")).max()))
    return None if worst == 0.0 else f"max abs diff {worst:.3g}"


def differs_cause(difference: str) -> str:
    """The cause a graph captured in eval semantics after the eval check names."""
    return (f"the train-mode trace differs from eager in eval mode ({difference}): something other than dropout "
            "depends on training (e.g. random choices made outside torch, outputs that depend on self.training); "
            "captured in eval semantics, the whole model in eval mode (its dropout modules stay switchable)")


def eval_mode_capture(model: nn.Module, attempt: Callable[[], tuple[fx.GraphModule, T]],
                      cause: str) -> tuple[fx.GraphModule, T, EvalSemantics]:
    """``attempt`` with the whole model in eval mode, its dropout modules in train mode (switchable)."""
    with _eval_mode(model, keep_dropout=True):
        gm, extra = attempt()
    return gm, extra, EvalSemantics(causes={"": cause}, whole_model=True)
