"""Hold a constructor-only subclass of a checkpointable torch.nn module as its torch.nn base class.

transformers' ``EfficientNetDepthwiseConv2d`` subclasses ``nn.Conv2d`` and overrides only ``__init__``: once
built, calling it runs exactly ``nn.Conv2d``'s code on the instance's state, yet checkpoints refuse its class.
The graph gets a shallow copy of such a module whose class is the base (same instance state and tensors, its
own ``_parameters`` / ``_buffers`` / ``_modules`` / hook dicts), so the checkpoint allowlist applies to the code
that actually runs. Only when nothing else can differ: every class between the module's class and the base
defines nothing but ``__init__`` and the names Python itself puts in a class body, is a plain ``type``, and the
method order above the base is the base's own (no mixin slipped in); the instance shadows no method of the base;
and the base is a registered torch.nn checkpoint class. The module passed in is never changed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .targets import CheckpointError, module_spec_for

__all__ = ["as_nn_base", "hold_as_nn_base", "is_held_copy"]

# What a class body holds without defining behaviour: the constructor (it already ran) and Python's own
# bookkeeping (3.13 adds __firstlineno__ / __static_attributes__, 3.14 the lazy-annotation names).
_INERT = frozenset({"__init__", "__module__", "__qualname__", "__doc__", "__annotations__", "__firstlineno__",
                    "__static_attributes__", "__annotate__", "__annotate_func__", "__annotations_cache__"})


def _nn_base(cls: type[nn.Module]) -> type[nn.Module] | None:
    """The nearest torch.nn class above ``cls`` when every class in between (``cls`` included) only builds."""
    mro = cls.__mro__
    index = next((i for i, c in enumerate(mro) if c.__module__.startswith("torch.nn.")), None)
    if not index:  # cls itself is torch.nn's (index 0), or no torch.nn class at all
        return None
    base = mro[index]
    if mro[index:] != base.__mro__:
        return None  # a class outside the base's own order sits above it (a mixin after the subclass)
    if any(type(c) is not type or set(vars(c)) - _INERT for c in mro[:index]):
        return None
    return base


def _shadows_base(module: nn.Module, base: type) -> bool:
    """Whether the instance holds its own value for one of the base's methods or descriptors."""
    return any(callable(a) or hasattr(a, "__get__")
               for a in (inspect.getattr_static(base, k, None) for k in vars(module)) if a is not None)


def as_nn_base(module: nn.Module) -> nn.Module | None:
    """A copy of ``module`` whose class is its registered torch.nn base, or None when it must keep its class."""
    cls = type(module)
    base = _nn_base(cls)
    if base is None or _shadows_base(module, base):
        return None
    held = object.__new__(base)
    held.__dict__.update({k: copy.copy(v) if isinstance(v, dict | set) else v for k, v in vars(module).items()})
    try:
        module_spec_for(held)
    except CheckpointError:
        return None
    return held


def is_held_copy(held: Any, module: Any) -> bool:
    """Whether ``held`` is ``module`` held as its torch.nn base (the capture cache rebinds such copies); the
    mode (``training``) may differ."""
    if not isinstance(held, nn.Module) or not isinstance(module, nn.Module) or _nn_base(type(module)) is not type(held):
        return False
    mine, theirs = vars(held), vars(module)
    return mine.keys() == theirs.keys() and all(
        v.keys() == theirs[k].keys() and all(x is theirs[k][n] for n, x in v.items()) if isinstance(v, dict)
        else v == theirs[k] if isinstance(v, set) else v is theirs[k] for k, v in mine.items() if k != "training")


def _call_targets(gm: fx.GraphModule) -> Iterator[str]:
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) not in seen:
            seen.add(str(node.target))
            yield str(node.target)


def hold_as_nn_base(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """Replace in ``gm`` every called module of an unregistered constructor-only subclass by a copy held as its
    torch.nn base (one copy per module object); returns the capture notes saying which and why."""
    originals = {id(m) for m in model.modules()}
    done: dict[int, nn.Module] = {}
    held: dict[tuple[type, type], list[str]] = {}
    for target in _call_targets(gm):
        module = gm.get_submodule(target)
        try:
            module_spec_for(module)
            continue  # already a checkpoint class
        except CheckpointError:
            pass
        parent_path, _, leaf = target.rpartition(".")
        parent = gm.get_submodule(parent_path)
        if parent is not gm and id(parent) in originals:
            continue  # the parent is the model's own module: setting the child would change the model
        copy_ = done.get(id(module)) or as_nn_base(module)
        if copy_ is None:
            continue
        done[id(module)] = copy_
        setattr(parent, leaf, copy_)
        held.setdefault((type(module), type(copy_)), []).append(target)
    return [_note(cls, base, paths) for (cls, base), paths in held.items()]


def _note(cls: type, base: type, paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return (f"modules {shown} ({cls.__module__}.{cls.__qualname__}) are held as torch.nn.{base.__name__}: their "
            f"class only defines __init__, so calling them runs exactly {base.__name__}'s code (checkpoints allow "
            "torch.nn's classes, not the subclass)")
