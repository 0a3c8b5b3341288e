"""Ops outside aten/prims/fxforge that checkpoints may name, each known individually (not by namespace).

An entry says what the op is (its exact schema), why it is a pure tensor function, which Python function
implements it, and which fixed module registers it. The loader allows a checkpoint's op only when the live
op matches all of that; the module imported is the table's, never a name taken from a checkpoint.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class KnownOp:
    """One audited op: what the live op must look like, and where it comes from."""

    schema: str  # exactly str(op._schema) of the op we audited
    why_pure: str  # why it only computes on its tensors (what a reviewer checked in the implementation)
    module: str  # the module fxforge imports to register it (fixed here, never read from a checkpoint)
    implementation: str  # module.qualname of the Python function torch.library runs for it
    distribution: str = "transformers"  # what to pip install when ``module`` is missing


# Keys are "namespace::op.overload", as torch names an OpOverload.
KNOWN_OPS: Mapping[str, KnownOp] = MappingProxyType({
    "transformers::grouped_mm_fallback.default": KnownOp(
        schema="transformers::grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor",
        why_pure="HF's MoE grouped matmul (experts_implementation='grouped_mm' on CPU/fp32 under export): "
                 "a new zeros output filled by torch.mm per expert slice of offs; registered with "
                 "mutates_args=(), reads no state beyond its three tensors",
        module="transformers.integrations.moe",
        implementation="transformers.integrations.moe._grouped_mm_fallback",
    ),
})


class KnownOpError(Exception):
    """A known op's library cannot be loaded; the message says what to install."""


def is_known(namespace: str, op: str) -> bool:
    """True when the table lists an overload of ``torch.ops.<namespace>.<op>`` (a pure lookup, no import)."""
    prefix = f"{namespace}::{op}."
    return any(key.startswith(prefix) for key in KNOWN_OPS)


def load(namespace: str, op: str) -> None:
    """Import the table's fixed module(s) for a known op not yet registered with torch (a no-op otherwise)."""
    if getattr(getattr(torch.ops, namespace), op, None) is not None:
        return
    prefix = f"{namespace}::{op}."
    for known in {k: v for k, v in KNOWN_OPS.items() if k.startswith(prefix)}.values():
        try:
            importlib.import_module(known.module)
        except ImportError as exc:
            raise KnownOpError(f"it is registered by {known.module}, which cannot be imported ({exc}); "
                               f"pip install {known.distribution} to load this checkpoint") from None


def refusal(op: torch._ops.OpOverload) -> str | None:
    """Why the live ``op`` is not the audited one (None when it matches its table entry exactly)."""
    qualified = f"{op.namespace}::{op._opname}.{op._overloadname}"
    known = KNOWN_OPS.get(qualified)
    if known is None:
        return f"its overload {qualified} is not one of the ops fxforge knows (graph/known_ops.py)"
    live = str(op._schema)
    if live != known.schema:
        return f"its live schema {live!r} differs from the audited schema {known.schema!r}"
    schema = op._schema
    if any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        return f"its schema {live!r} writes to or aliases its arguments"
    impl = _implementation(f"{op.namespace}::{op._opname}")
    if impl != known.implementation:
        return f"it is not registered by {known.implementation} (here it runs {impl or 'no torch.library custom op'})"
    return None


def op_schema(fn: object) -> str | None:
    """The schema a checkpoint records for an op outside aten/prims (all overloads of a packet), else None.

    The loader compares it with the live op, so a kernel whose signature changed since saving (a user's
    registered namespace, or a known op) is refused instead of called with arguments bound for another.
    """
    if isinstance(fn, torch._ops.OpOverloadPacket):
        ops = [getattr(fn, o) for o in fn.overloads()]
    elif isinstance(fn, torch._ops.OpOverload):
        ops = [fn]
    else:
        return None
    return None if ops[0].namespace in ("aten", "prims") else "; ".join(str(o._schema) for o in ops)


def _implementation(qualname: str) -> str | None:
    """module.qualname of the Python function a torch.library custom op runs (None if not a custom op)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(qualname)
    fn = getattr(opdef, "_init_fn", None)
    return None if fn is None else f"{fn.__module__}.{fn.__qualname__}"
