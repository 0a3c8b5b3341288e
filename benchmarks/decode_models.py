"""bench_decode_lowbit's models: a seeded random Llama, its HF static-cache decode step, and hand-made
weight-only linears straight on ATen's CPU kernels (the baselines the fxforge lowering is measured against).

A decode step is batch 1, one new token, attending to ``cache_len`` cached positions: the cache is filled
once (from an fp32 prefill of a prompt, so every variant sees the same keys and values) and each call
rewinds the cache's write position, so repeated calls do identical work.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch import Tensor  # noqa: E402

__all__ = ["LLAMA_134M", "LLAMA_TINY", "AtenInt4Linear", "AtenInt8Linear", "EagerDecode", "build_llama",
           "error_text", "prefill_kv", "swap_linears", "torchao_model"]

LLAMA_134M: dict[str, int] = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                              "intermediate_size": 2048, "vocab_size": 32000}
LLAMA_TINY: dict[str, int] = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "intermediate_size": 256, "vocab_size": 512}
KV = tuple[list[Tensor], list[Tensor]]  # per-layer keys and values, each [batch, kv_heads, length, head_dim]


def build_llama(config: dict[str, int], seed: int = 0) -> nn.Module:
    """A LlamaForCausalLM with HF's random init under ``seed``, in eval mode (untied lm_head, SDPA)."""
    import transformers as T

    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {**config, "max_position_embeddings": 1024, "tie_word_embeddings": False}
    cfg = T.LlamaConfig(**kwargs)
    return T.LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def prefill_kv(model: nn.Module, prompts: Tensor, chunk: int = 8) -> KV:
    """Keys and values of ``model`` over ``prompts`` [n, length] (fp32 eager, ``chunk`` prompts at a time)."""
    keys: list[list[Tensor]] = []
    values: list[list[Tensor]] = []
    for part in prompts.split(chunk):
        cache = model(part, use_cache=True, logits_to_keep=1).cache
        keys.append([layer.keys for layer in cache.layers])
        values.append([layer.values for layer in cache.layers])
    return ([torch.cat(k) for k in zip(*keys)], [torch.cat(v) for v in zip(*values)])


class EagerDecode:
    """An HF model's decode step on a StaticCache of ``cache_len + 1`` slots: ``load(kv, i, token)`` puts prompt
    ``i``'s cache in place, ``step()`` returns the next-token logits [vocab] as fp32."""

    def __init__(self, model: nn.Module, cache_len: int, dtype: torch.dtype = torch.float32) -> None:
        from transformers import StaticCache

        cfg: Any = model.config
        self.model, self.cache_len, self.dtype = model, cache_len, dtype
        self.cache = StaticCache(config=cfg, max_cache_len=cache_len + 1)
        self.layers: list[Any] = list(self.cache.layers)  # StaticLayers (typed as any cache layer)
        heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.cache.early_initialization(1, heads, cfg.hidden_size // cfg.num_attention_heads, dtype,
                                        torch.device("cpu"))
        self.token = torch.zeros(1, 1, dtype=torch.long)

    def load(self, kv: KV, index: int, token: int) -> None:
        """Copy prompt ``index``'s keys/values into the first ``cache_len`` slots; ``token`` is the step's input."""
        for layer, k, v in zip(self.layers, *kv):
            layer.keys[:, :, :self.cache_len].copy_(k[index:index + 1])
            layer.values[:, :, :self.cache_len].copy_(v[index:index + 1])
        self.token.fill_(token)

    @torch.inference_mode()
    def step(self) -> Tensor:
        for layer in self.layers:  # rewind: the new token is written to slot cache_len every call
            layer.cumulative_length.fill_(self.cache_len)
        return self.model(self.token, cache=self.cache, use_cache=True).logits[0, -1].float()


class AtenInt8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights, ``aten._weight_int8pack_mm`` (activations stay fp32)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.register_buffer("weight", torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scale.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class AtenInt4Linear(nn.Module):
    """Group-wise symmetric int4 weights (``group`` inputs share a scale), ``aten._weight_int4pack_mm_for_cpu``;
    activations are cast to ``act_dtype`` (bf16: torchao's tinygemm convention) and back."""

    def __init__(self, linear: nn.Linear, group: int = 128, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if k % group:
            raise ValueError(f"AtenInt4Linear: in_features {k} is not a multiple of the group size {group}")
        w = linear.weight.detach().float().reshape(n, k // group, group)
        scale = (w.abs().amax(-1, keepdim=True) / 7).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (torch.clamp(torch.round(w / scale), -8, 7) + 8).to(torch.int32).reshape(n, k)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        # [k // group, n, 2]: scale and the float-domain zero (0: symmetric); w = (code - 8) * scale + zero
        zeros = torch.zeros(k // group, n)
        self.register_buffer("scale_zeros", torch.stack([scale[..., 0].t(), zeros], -1).to(act_dtype).contiguous())
        self.group, self.act_dtype, self.out_features = group, act_dtype, n
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        a = x.reshape(-1, x.shape[-1]).to(self.act_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.weight, self.group, self.scale_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """A deep copy of ``model`` with every nn.Linear (the LM head included) replaced by ``make(linear)``."""
    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        if type(mod) is nn.Linear:
            parent, _, leaf = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, leaf, make(mod))
    return out


def torchao_model(model: nn.Module, config: Any, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` with torchao's ``quantize_(config)`` applied (raises what torchao raises)."""
    from torchao.quantization import quantize_

    out = copy.deepcopy(model).to(dtype)
    quantize_(out, config)
    return out


def error_text(e: BaseException) -> str:
    """``Type: first line`` of an exception (at most 200 characters), for a variant that did not run."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
