"""bench_decode_lowbit's fxforge variants: the decode step captured with an explicit static KV cache
(graph/static_cache), as is (fp32) and after quantize_transform_pass (int8 per-channel / MXINT4 weight-only)
+ lower_weight_only_transform_pass (the simulated formats mapped to real low-bit kernels).

The captured step is a pure function ``(input_ids, cache_position, *caches) -> (logits, *caches')``; it runs
through ``inplace_cache_updates`` (the same graph writing the step's keys and values into the given caches, as
HF's static cache does, instead of copying every cache per token), always at position ``cache_len``, so
repeated calls do identical work.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from fxforge.benchmarks.decode_models import error_text
from fxforge.graph.forge_graph import ForgeGraph
from fxforge.graph.static_cache import capture_static_cache, inplace_cache_updates, static_cache_spec
from fxforge.passes.quantize import quantize_transform_pass
from fxforge.passes.quantize.lower_weight_only import lower_weight_only_transform_pass

__all__ = ["FxforgeDecode", "INT4_WEIGHT_ONLY", "INT8_WEIGHT_ONLY", "fxforge_decoders", "int4_weight_only"]

INT8_WEIGHT_ONLY: dict[str, Any] = {
    "by": "type", "default": {"config": {"name": None}},
    "linear": {"config": {"name": "scaled_integer", "weight_width": 8, "weight_granularity": "per_channel"}}}


def int4_weight_only(block: int) -> dict[str, Any]:
    """MXINT4 weights (an E8M0 power-of-two scale per ``block`` inputs) on every linear; activations float."""
    return {"by": "type", "default": {"config": {"name": None}},
            "linear": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": block}}}


INT4_WEIGHT_ONLY = int4_weight_only(128)


class FxforgeDecode:
    """A static-cache graph's decode step at position ``cache_len`` (see bench_decode_lowbit.Decoder)."""

    def __init__(self, mg: ForgeGraph, cache_len: int) -> None:
        spec = static_cache_spec(mg)
        if spec.batch != 1 or spec.max_cache_len != cache_len + 1:
            raise ValueError(f"FxforgeDecode: the graph's cache is batch {spec.batch} x {spec.max_cache_len} slots, "
                             f"the benchmark needs batch 1 x {cache_len + 1}")
        self.mg, self.run, self.cache_len = mg, inplace_cache_updates(mg), cache_len
        self.cache = spec.empty()
        self.token = torch.zeros(1, 1, dtype=torch.long)
        self.position = torch.tensor([cache_len])

    def load(self, kv: Any, index: int, token: int) -> None:
        keys, values = kv
        for i, (k, v) in enumerate(zip(keys, values)):
            self.cache[2 * i][:, :, :self.cache_len].copy_(k[index:index + 1])
            self.cache[2 * i + 1][:, :, :self.cache_len].copy_(v[index:index + 1])
        self.token.fill_(token)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        return self.run(self.token, self.position, *self.cache)[0][0, -1].float()


def fxforge_decoders(model: nn.Module, cache_len: int, int4_block: int = 128
                     ) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(decoders, errors, weight formats) of fxforge-fp32 / -int8 / -int4; a step that cannot be built (capture
    or a pass refusing) is an error with its text, the others still run."""
    decoders: dict[str, Any] = {}
    errors: dict[str, str] = {}
    formats = {"fxforge-fp32": "fp32", "fxforge-int8": "int8", "fxforge-int4": "int4" if int4_block == 128
               else f"int4-{int4_block}"}
    try:
        export_log = logging.getLogger("torch._export")  # one "specialized" line per cache input: noise here
        level = export_log.level
        export_log.setLevel(logging.ERROR)
        try:
            fp32 = capture_static_cache(model, cache_len + 1, share_weights=True)
        finally:
            export_log.setLevel(level)
        decoders["fxforge-fp32"] = FxforgeDecode(fp32, cache_len)
    except Exception as e:  # noqa: BLE001 -- reported in the table, the eager variants still run
        return {}, {name: f"capture: {error_text(e)}" for name in formats}, formats
    for name, config in (("fxforge-int8", INT8_WEIGHT_ONLY), ("fxforge-int4", int4_weight_only(int4_block))):
        try:
            decoders[name] = FxforgeDecode(lowered(fp32, config), cache_len)
        except Exception as e:  # noqa: BLE001
            errors[name] = error_text(e)
    return decoders, errors, formats


def lowered(mg: ForgeGraph, config: dict[str, Any]) -> ForgeGraph:
    """A copy of ``mg`` quantized with ``config`` and lowered to weight-only kernels; every linear must lower
    (a format left simulated would time fp32 matmuls under a low-bit name)."""
    q, _ = quantize_transform_pass(mg.copy(), config)
    q, _ = lower_weight_only_transform_pass(q, {"strict": True})  # strict: refuses to leave a layer simulated
    return q
