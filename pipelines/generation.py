"""Greedy generation from a graph captured with an explicit static KV cache (graph/static_cache).

One prefill step writes the prompt into a zeroed cache, then one decode step per new token feeds the returned
caches back: the graph is a pure function, so the loop holds the only state (the caches and the position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..graph.forge_graph import ForgeGraph
from ..graph.static_cache import StaticCacheSpec, cache_inputs, static_cache_spec

__all__ = ["generate"]


def _prompt(prompt_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], spec: StaticCacheSpec) -> torch.Tensor:
    """The prompt as a [batch, length] long tensor of the graph's batch; ValueError naming what is wrong."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty list of token ids or a [batch, length] tensor, got shape "
                         f"{tuple(ids.shape)}")
    if ids.shape[0] != spec.batch:
        raise ValueError(f"the graph was captured for batch {spec.batch}, the prompt has {ids.shape[0]} rows: "
                         f"capture_static_cache(model, max_cache_len, batch={ids.shape[0]})")
    return ids


@torch.no_grad()
def generate(mg: ForgeGraph, prompt_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
             max_new_tokens: int, eos_token_ids: Sequence[int] | None = None) -> torch.Tensor:
    """The prompt followed by up to ``max_new_tokens`` greedily chosen tokens ([batch, length] long tensor), as
    HF ``model.generate(..., do_sample=False)`` returns them. Generation stops once every row has produced an
    end-of-sequence token (``eos_token_ids``, default the model's own, recorded at capture; ``[]``: never);
    rows that finished earlier are padded with their first eos id, as HF pads with its pad token."""
    spec = static_cache_spec(mg)
    ids = _prompt(prompt_ids, spec)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = tuple(spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if ids.shape[1] + max_new_tokens - 1 > spec.max_cache_len:
        raise ValueError(f"a {ids.shape[1]}-token prompt plus {max_new_tokens} new tokens needs "
                         f"{ids.shape[1] + max_new_tokens - 1} cache slots, the graph has {spec.max_cache_len}: "
                         "capture with a larger max_cache_len")
    if max_new_tokens == 0:
        return ids
    was_training = mg.model.training
    mg.eval()
    try:
        out = [ids]
        cache: tuple[torch.Tensor, ...] = tuple(spec.empty())
        step, start = ids, 0
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        eos_t = torch.tensor(eos, dtype=torch.long)
        for i in range(max_new_tokens):
            logits, *rest = mg(*cache_inputs(spec, step, start, cache))
            cache = tuple(rest)
            token = logits[:, -1].argmax(-1)
            if eos:
                token = torch.where(done, eos_t[0], token)
                done |= torch.isin(token, eos_t)
            out.append(token[:, None])
            if bool(done.all()) or i == max_new_tokens - 1:
                break
            start += step.shape[1]
            step = token[:, None]
        return torch.cat(out, dim=1)
    finally:
        mg.train(was_training)
