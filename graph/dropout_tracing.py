"""Export train-mode dropout without its slow fake-tensor paths: stand-in ops ``torch.ops.fxforge.sdpa_dropout``
and ``torch.ops.fxforge.dropout``.

Capture traces in train mode so dropout stays switchable. HF attention then calls
``F.scaled_dot_product_attention(..., dropout_p=p)`` and, with ``p > 0``, torch.export's fake tracing of SDPA
runs the math fallback (matmul, softmax, dropout) op by op under symbolic shapes: on MiniLM at dynamic shapes
the export took ~60% longer than in eval mode; each ``F.dropout`` decomposes into a Bernoulli mask too. While
exporting, :class:`DropoutTracing` sends this thread's such calls to opaque ops whose shape rules cost nothing
and give the layouts the real train-mode calls give (SDPA's math path: a contiguous ``[*batch, L, Ev]``;
dropout: like its input), so the model's later ``contiguous``/``view`` calls trace as in a plain train-mode
export. Normalisation turns the op nodes into switchable ``ScaledDotProductAttention`` and
``nn.Dropout`` modules, exactly as it does for SDPA and dropout nodes with a baked probability.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SDPA_ARG_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@torch.library.custom_op("fxforge::sdpa_dropout", mutates_args=())
def sdpa_dropout(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """SDPA with its dropout always on: a capture-time stand-in, replaced by a module during normalisation."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                          enable_gqa=enable_gqa)


@sdpa_dropout.register_fake
def _sdpa_dropout_fake(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                       is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor:
    """The math path's shape rule without its ops: the same size checks (so export proves the same equalities,
    e.g. mask length == key length) and its layout, a contiguous ``[*batch, L, Ev]``."""
    torch._check(query.shape[-1] == key.shape[-1], lambda: "SDPA: query and key feature sizes differ")
    torch._check(key.shape[-2] == value.shape[-2], lambda: "SDPA: key and value lengths differ")
    key_batch, value_batch = list(key.shape[:-2]), list(value.shape[:-2])
    if enable_gqa and query.dim() >= 3:  # key/value heads are repeated to the query's
        key_batch[-1] = value_batch[-1] = query.shape[-3]
    batch = torch.broadcast_shapes(tuple(query.shape[:-2]), tuple(key_batch), tuple(value_batch))
    if attn_mask is not None:
        torch.broadcast_shapes(tuple(attn_mask.shape), (*batch, query.shape[-2], key.shape[-2]))
    return query.new_empty((*batch, query.shape[-2], value.shape[-1]))


@torch.library.custom_op("fxforge::dropout", mutates_args=())
def dropout(input: Tensor, p: float) -> Tensor:
    """Dropout always on: a capture-time stand-in, replaced by an ``nn.Dropout`` during normalisation."""
    return F.dropout(input, p, training=True)


@dropout.register_fake
def _dropout_fake(input: Tensor, p: float) -> Tensor:
    return torch.empty_like(input)


# Matched by qualified name, not OpOverload identity: a re-registered op (e.g. a second import of the package)
# gets new OpOverload objects, and identity checks would then miss the stand-ins and leave dropout on.
_NAMES = {"fxforge::dropout": "dropout", "fxforge::sdpa_dropout": "sdpa"}


def stand_in_kind(target: Any) -> str | None:
    """``"dropout"`` / ``"sdpa"`` for a capture stand-in op (any OpOverload object of it), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return _NAMES.get(target.name())
    return None


def bind_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """SDPA's arguments by name, from a call's (or a node's) args and kwargs."""
    bound = dict(zip(SDPA_ARG_NAMES, args))
    bound.update(kwargs)
    return bound


_SDPA_FN = F.scaled_dot_product_attention
_DROPOUT_FN = F.dropout
_active = threading.local()  # .tracing: the DropoutTracing active in this thread (None: calls pass through)
_lock = threading.Lock()
_installed = 0  # DropoutTracing contexts open in any thread (the wrappers are installed while > 0)


def _tracing() -> DropoutTracing | None:
    return getattr(_active, "tracing", None)


def _traced_sdpa(*args: Any, **kwargs: Any) -> Any:
    """``F.scaled_dot_product_attention`` while a DropoutTracing is open (see :class:`DropoutTracing`)."""
    tracing = _tracing()
    if tracing is None:
        return _SDPA_FN(*args, **kwargs)
    bound = bind_sdpa(args, kwargs)
    p, causal = bound.get("dropout_p", 0.0), bound.get("is_causal", False)
    scale, gqa, mask, query = bound.get("scale"), bound.get("enable_gqa", False), bound.get("attn_mask"), \
        bound.get("query")
    plain = type(p) in (float, int) and type(causal) is bool and type(gqa) is bool and isinstance(query, Tensor) \
        and (scale is None or type(scale) in (float, int)) and (mask is None or isinstance(mask, Tensor))
    if not plain or not isinstance(query, Tensor) or p == 0 or torch.is_autocast_enabled(query.device.type):
        return _SDPA_FN(*args, **kwargs)
    tracing.redirected += 1
    return torch.ops.fxforge.sdpa_dropout(query, bound["key"], bound["value"], mask, float(p), causal,
                                          None if scale is None else float(scale), gqa)


def _traced_dropout(*args: Any, **kwargs: Any) -> Any:
    """``F.dropout`` while a DropoutTracing is open (see :class:`DropoutTracing`)."""
    tracing = _tracing()
    if tracing is None:
        return _DROPOUT_FN(*args, **kwargs)
    bound = dict(zip(("input", "p", "training", "inplace"), args))
    bound.update(kwargs)
    p, x = bound.get("p", 0.5), bound.get("input")
    if bound.get("training", True) is not True or bound.get("inplace", False) is not False or \
            type(p) not in (float, int) or not 0 < p < 1 or not isinstance(x, Tensor):
        return _DROPOUT_FN(*args, **kwargs)
    tracing.redirected += 1
    return torch.ops.fxforge.dropout(x, float(p))


class DropoutTracing:
    """While open, this thread's ``F.scaled_dot_product_attention`` calls with a constant ``dropout_p > 0`` and
    ``F.dropout`` calls in training with a constant ``p > 0`` go to the stand-in ops (see the module docstring);
    ``redirected`` counts them. In-place dropout stays as it is (the stand-in returns a new tensor).

    The two functions of ``torch.nn.functional`` are swapped for wrappers while any DropoutTracing is open
    (a TorchFunctionMode would do it without touching the module, but it runs Python on every torch call and
    made a static MiniLM export ~8% slower). The wrappers check a thread-local, so other threads' calls go to
    the originals unchanged, and code holding its own reference to the originals is traced the slow, correct
    way. SDPA calls under an enabled autocast stay as they are: export keeps them in a region that
    normalisation does not inline, so the op could not be replaced there."""

    def __init__(self) -> None:
        self.redirected = 0
        self._outer: DropoutTracing | None = None

    def __enter__(self) -> DropoutTracing:
        global _installed
        with _lock:
            if _installed == 0:
                F.scaled_dot_product_attention = _traced_sdpa
                F.dropout = _traced_dropout
            _installed += 1
        self._outer = _tracing()
        _active.tracing = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _installed
        _active.tracing = self._outer
        with _lock:
            _installed -= 1
            if _installed == 0:
                F.scaled_dot_product_attention = _SDPA_FN
                F.dropout = _DROPOUT_FN
