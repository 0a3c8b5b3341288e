"""Decoder LMs captured with their KV cache as explicit graph inputs and outputs (a static cache).

:func:`capture_static_cache` captures one step of a HuggingFace causal LM as a pure function

    (input_ids [B, T], cache_position [T], k_0, v_0, ..., k_{L-1}, v_{L-1}) -> (logits [B, T, V], k_0', v_0', ...)

where each cache tensor is [B, heads, max_cache_len, head_dim] and the step writes its T new keys and values at
``cache_position`` with ``index_copy`` (a new tensor, never an in-place write), so a generation loop feeds the
returned caches back. T is dynamic: the same graph runs the prefill (T = prompt length) and each decode step
(T = 1). Slots not yet written are masked by position (key slot j is seen by query position p iff j <= p), which
is the mask transformers' own static cache builds. The cache layout is recorded as a JSON capture note (and the
example inputs hold tensors of the cache's shapes), so a reloaded checkpoint carries what generation needs.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .forge_graph import ForgeGraph

__all__ = ["NOTE_PREFIX", "StaticCacheLM", "StaticCacheSpec", "cache_inputs", "capture_static_cache",
           "inplace_cache_updates", "static_cache_spec"]

NOTE_PREFIX = "static_kv_cache: "  # the capture note holding the cache spec as JSON
_MAX_NOTE = 100_000  # characters: a checkpoint's note is hostile
_MAX_DIM = 1 << 24
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class StaticCacheSpec:
    """The cache a static-cache graph takes: per layer (heads, key dim, value dim), batch, length, dtype; and
    the end-of-sequence token ids generation stops at (the model's generation config; empty: none)."""

    batch: int
    max_cache_len: int
    layers: tuple[tuple[int, int, int], ...]
    dtype: str
    eos_token_ids: tuple[int, ...] = ()

    def shapes(self) -> list[tuple[int, ...]]:
        """Shapes of k_0, v_0, k_1, v_1, ... in graph input order."""
        out: list[tuple[int, ...]] = []
        for heads, k_dim, v_dim in self.layers:
            out += [(self.batch, heads, self.max_cache_len, k_dim), (self.batch, heads, self.max_cache_len, v_dim)]
        return out

    def empty(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """A zeroed cache (what a generation starts from)."""
        return [torch.zeros(s, dtype=_DTYPES[self.dtype], device=device) for s in self.shapes()]

    def to_json(self) -> str:
        return json.dumps({"batch": self.batch, "max_cache_len": self.max_cache_len,
                           "layers": [list(x) for x in self.layers], "dtype": self.dtype,
                           "eos_token_ids": list(self.eos_token_ids)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StaticCacheSpec:
        """Rebuild a spec from a (hostile) note: every field type- and range-checked, ValueError naming it."""
        if len(text) > _MAX_NOTE:
            raise ValueError(f"static cache note is {len(text)} characters (at most {_MAX_NOTE})")
        doc = json.loads(text)
        if not isinstance(doc, dict) or set(doc) != {"batch", "max_cache_len", "layers", "dtype", "eos_token_ids"}:
            raise ValueError("static cache note must be an object with batch, max_cache_len, layers, dtype, "
                             "eos_token_ids")

        def dim(v: Any, what: str) -> int:
            if type(v) is not int or not 0 < v <= _MAX_DIM:
                raise ValueError(f"static cache note: {what} must be an integer in [1, {_MAX_DIM}], got {v!r}"[:200])
            return v

        layers = doc["layers"]
        if not isinstance(layers, list) or not layers or len(layers) > 4096 or \
                not all(isinstance(x, list) and len(x) == 3 for x in layers):
            raise ValueError("static cache note: layers must be a non-empty list of [heads, key_dim, value_dim]")
        if doc["dtype"] not in _DTYPES:
            raise ValueError(f"static cache note: dtype must be one of {list(_DTYPES)}")
        eos = doc["eos_token_ids"]
        if not isinstance(eos, list) or len(eos) > 64 or not all(type(e) is int and 0 <= e < _MAX_DIM for e in eos):
            raise ValueError("static cache note: eos_token_ids must be a short list of token ids")
        return cls(batch=dim(doc["batch"], "batch"), max_cache_len=dim(doc["max_cache_len"], "max_cache_len"),
                   layers=tuple((dim(h, "heads"), dim(k, "key_dim"), dim(v, "value_dim")) for h, k, v in layers),
                   dtype=doc["dtype"], eos_token_ids=tuple(eos))


def static_cache_spec(mg: ForgeGraph) -> StaticCacheSpec:
    """The cache spec of a graph captured by :func:`capture_static_cache` (also after a checkpoint reload),
    checked against the example inputs' cache tensors; ValueError when the graph has none."""
    notes = [n[len(NOTE_PREFIX):] for n in mg.capture_notes if n.startswith(NOTE_PREFIX)]
    if len(notes) != 1:
        raise ValueError("this graph has no static KV cache (no static_kv_cache capture note): capture the decoder "
                         "with fxforge.graph.static_cache.capture_static_cache(model, max_cache_len)")
    spec = StaticCacheSpec.from_json(notes[0])
    ex = mg.example_inputs
    shapes = [tuple(t.shape) for t in ex.args[2:]] if ex is not None else None
    if shapes is not None and shapes != spec.shapes():
        raise ValueError(f"static cache note says cache shapes {spec.shapes()[:2]}..., the example inputs hold "
                         f"{shapes[:2]}...: the checkpoint is inconsistent")
    return spec


@functools.cache
def _layer_class() -> type:
    """A transformers cache layer over given tensors whose update returns new tensors (imported lazily: loading
    transformers is slow and noisy, and only static-cache capture needs it)."""
    from transformers.cache_utils import CacheLayerMixin

    class FunctionalStaticLayer(CacheLayerMixin):
        """One layer's static cache as values: ``update`` writes the step's keys and values at the step's
        positions into copies (index_copy) and returns them; the graph outputs them."""

        is_compileable = True  # a fixed-size cache (the step passes its own 4-d mask, so HF builds none)
        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.positions = keys, values, positions
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            return None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self._kv()
            self.keys = keys.index_copy(2, self.positions, key_states.to(keys.dtype))
            self.values = values.index_copy(2, self.positions, value_states.to(values.dtype))
            return self.keys, self.values

        def _kv(self) -> tuple[torch.Tensor, torch.Tensor]:
            if self.keys is None or self.values is None:
                raise RuntimeError("FunctionalStaticLayer holds no cache tensors")
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return int(self._kv()[0].shape[2]), 0

        def get_seq_length(self) -> Any:
            return self.positions[0]

        def get_max_length(self) -> int:
            return int(self._kv()[0].shape[2])

    return FunctionalStaticLayer


class StaticCacheLM(nn.Module):
    """One step of a HF causal LM over an explicit static cache (see the module docstring); ``lm`` is the
    model, so its parameters are named ``lm.<HF name>``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        impl = getattr(getattr(lm, "config", None), "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"static cache capture supports sdpa and eager attention, the model uses {impl!r}: "
                             "load it with attn_implementation='sdpa'")
        self.additive_mask = impl == "eager"

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor,
                *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers.cache_utils import Cache

        layer_cls = _layer_class()
        layers = [layer_cls(cache[2 * i], cache[2 * i + 1], cache_position) for i in range(len(cache) // 2)]
        slots = torch.arange(cache[0].shape[2], device=input_ids.device)
        seen = (slots[None, :] <= cache_position[:, None])[None, None].expand(input_ids.shape[0], 1, -1, -1)
        mask: torch.Tensor = seen
        if self.additive_mask:  # eager attention adds the mask to the scores
            mask = torch.zeros(seen.shape, dtype=cache[0].dtype, device=seen.device).masked_fill(
                ~seen, torch.finfo(cache[0].dtype).min)
        out = self.lm(input_ids=input_ids, attention_mask=mask, position_ids=cache_position.unsqueeze(0),
                      cache=Cache(layers=layers), use_cache=True)
        return (out.logits, *[t for layer in layers for t in (layer.keys, layer.values)])


def _probe_spec(lm: nn.Module, batch: int, max_cache_len: int) -> StaticCacheSpec:
    """Cache layout read off one eager step with transformers' dynamic cache (so GQA heads, GPT-2's fused
    projections and head_dim overrides need no per-family code); refuses sliding-window layers."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    config: Any = lm.config
    probe = DynamicCache(config=config)
    with torch.no_grad():
        lm(input_ids=torch.zeros(batch, 1, dtype=torch.long), cache=probe, use_cache=True)
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer}
    kv = [(x.keys, x.values) for x in probe.layers if isinstance(x, DynamicLayer)]
    if kinds or not kv:
        raise ValueError(f"static cache capture supports full-attention layers only; {type(lm).__name__} has "
                         f"{sorted(kinds) or 'no cache layers'}")
    shapes = [(k.shape, v.shape) for k, v in kv if k is not None and v is not None]
    if len(shapes) != len(kv):
        raise ValueError(f"{type(lm).__name__} left a cache layer unwritten in one step: not a plain decoder")
    layers = tuple((int(k[1]), int(k[-1]), int(v[-1])) for k, v in shapes)
    dtype = next((name for name, d in _DTYPES.items() if kv[0][0] is not None and d == kv[0][0].dtype), "")
    if not dtype:
        raise ValueError(f"static cache capture supports cache dtypes {list(_DTYPES)}")
    eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    eos_ids = tuple(int(e) for e in ([] if eos is None else [eos] if isinstance(eos, int) else eos))
    return StaticCacheSpec(batch=batch, max_cache_len=max_cache_len, layers=layers, dtype=dtype, eos_token_ids=eos_ids)


def capture_static_cache(model: nn.Module, max_cache_len: int, batch: int = 1, example_len: int = 2,
                         share_weights: bool = False) -> ForgeGraph:
    """Capture a HF causal LM's step over an explicit static cache of ``max_cache_len`` tokens (see the module
    docstring). ``batch`` is fixed in the graph; the step's length T is dynamic (traced at ``example_len`` >= 2,
    so T = 1 is not specialised away). ``share_weights`` as for ForgeGraph (no second copy of a large model).
    The graph is captured in eval mode: call it as ``mg(input_ids, cache_position, *caches)``."""
    if not 2 <= example_len <= max_cache_len:
        raise ValueError(f"example_len must be in [2, max_cache_len={max_cache_len}], got {example_len}: a length-1 "
                         "example would fix T to 1")
    spec = _probe_spec(model, batch, max_cache_len)
    step = StaticCacheLM(model).eval()
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2))
    gen = torch.Generator().manual_seed(0)
    example = (torch.randint(0, vocab, (batch, example_len), generator=gen), torch.arange(example_len),
               *spec.empty())
    mg = ForgeGraph(step, example_inputs=example, frontend="export", share_weights=share_weights)
    mg.eval()
    mg.capture_notes = (*mg.capture_notes, NOTE_PREFIX + spec.to_json())
    return mg


def cache_inputs(spec: StaticCacheSpec, input_ids: torch.Tensor, start: int,
                 cache: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The graph's arguments for a step writing ``input_ids`` at positions ``start ..`` of ``cache``."""
    length = int(input_ids.shape[1])
    if start + length > spec.max_cache_len:
        raise ValueError(f"positions {start}..{start + length - 1} are past the cache's {spec.max_cache_len} slots: "
                         "capture with a larger max_cache_len")
    return (input_ids, torch.arange(start, start + length, device=input_ids.device), *cache)


_SHAPE_ONLY = (torch.ops.aten.sym_size.int,)


def inplace_cache_updates(mg: ForgeGraph) -> ForgeGraph:
    """A copy of a static-cache graph (weights shared) writing each step's keys and values into the cache tensors
    it is given (``index_copy_``) instead of into new ones, so a step does not copy the whole cache (what HF's
    own static cache does; for timing loops and long generations). The returned caches are the inputs. Not a
    pure function any more: for running, not for passes or checkpoints (the pure graph is the one to keep)."""
    static_cache_spec(mg)  # refuses a graph without a cache
    out = mg.copy(share_weights=True)
    graph = out.model.graph
    caches = [n for n in graph.nodes if n.op == "placeholder"][2:]
    for node in caches:
        writes = [u for u in node.users if u.target is torch.ops.aten.index_copy.default and u.args[0] is node]
        others = [u for u in node.users if u not in writes and u.target not in _SHAPE_ONLY
                  and not str(u.name).startswith("fxforge_shape_guard")]
        if len(writes) != 1 or others:
            raise ValueError(f"cache input {node.name!r} is read by {[u.name for u in others][:3]} besides its one "
                             "index_copy: a pass changed how the cache is used, so it cannot be updated in place")
        writes[0].target = torch.ops.aten.index_copy_.default
    out.recompile()
    return out
