"""Vocabulary-parallel layers for tensor parallelism: the large embedding tables, and the output heads over their
vocabulary, split by rows across the ranks.

Splitting the transformer layers alone leaves every rank the whole of each embedding: MiniLM's word embeddings are
52 % of its parameters, so each of 2 ranks kept 0.77x of the model. An ``nn.Embedding`` split by rows (DTensor's
``RowwiseParallel`` with replicated ids) looks each id up on the rank holding its row, zeros elsewhere, and one
all-reduce sums them: exact. A Linear whose outputs are a split table's vocabulary (a language model's head) is split
column-wise with its output gathered (``ColwiseParallel(output_layouts=Replicate())``). Tables under ``MIN_SHARE`` of
the graph's parameters (BERT's position and token-type tables) stay whole: each split one costs an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["MIN_SHARE", "VocabLayers", "VocabParallelError", "vocab_layers"]

MIN_SHARE = 0.01  # a table holding less of the graph's parameters stays whole


class VocabParallelError(ValueError):
    """An embedding or head cannot be split by rows; the message names the layer."""


@dataclass(frozen=True)
class VocabLayers:
    """The embeddings split by rows and the heads split by output columns (module paths, graph order), and the
    large tables kept whole with the reason (``vocab_parallel="auto"``: a table that cannot be split)."""

    embeddings: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    whole: tuple[tuple[str, str], ...] = ()


def _shared_with(gm: fx.GraphModule, path: str, weight: torch.Tensor) -> list[str]:
    """Other places that reach ``weight``: modules sharing the Parameter (tied weights), get_attr nodes reading it."""
    own = f"{path}.weight"
    others = [name for name, p in gm.named_parameters(remove_duplicate=False) if p is weight and name != own]
    return others + [str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.target == own]


def _embedding(gm: fx.GraphModule, path: str, m: nn.Module, world: int) -> None:
    """Refuse, naming ``path``, an embedding that row-wise splitting would change or cannot cover."""
    fix = "pass vocab_parallel=False to keep the embeddings whole"
    if type(m) is not nn.Embedding:
        raise VocabParallelError(f"tensor_parallel: embedding {path!r} is a {type(m).__name__}, not a plain "
                                 f"nn.Embedding: its rows cannot be split by DTensor ({fix})")
    if m.max_norm is not None:
        raise VocabParallelError(f"tensor_parallel: embedding {path!r} renormalises the rows it looks up (max_norm="
                                 f"{m.max_norm}): a split table cannot ({fix})")
    if m.num_embeddings < world:
        raise VocabParallelError(f"tensor_parallel: embedding {path!r} has {m.num_embeddings} rows, fewer than the "
                                 f"{world} ranks ({fix})")
    shared = _shared_with(gm, path, m.weight)
    if shared:
        raise VocabParallelError(f"tensor_parallel: embedding {path!r} shares its weight with {', '.join(shared)} "
                                 f"(tied weights): it cannot be split apart from them ({fix})")
    if not any(n.op == "call_module" and n.target == path for n in gm.graph.nodes):
        raise VocabParallelError(f"tensor_parallel: embedding {path!r} is not called as a module in the graph "
                                 f"({fix})")


def vocab_layers(gm: fx.GraphModule, world: int, taken: set[str], strict: bool = True) -> VocabLayers:
    """The embeddings holding at least ``MIN_SHARE`` of ``gm``'s parameters and the plain Linear heads (not in
    ``taken``, the layers already split) whose outputs are one of those tables' rows. A table that cannot be split
    (a subclass, max_norm, tied or read as a tensor, fewer rows than ranks) is refused naming it when ``strict``,
    else kept whole and listed with the reason (splitting it is an optimisation; keeping it whole stays exact)."""
    total = sum(p.numel() for p in gm.parameters())
    modules = dict(gm.named_modules())
    big = [p for p, m in modules.items() if isinstance(m, nn.Embedding) and m.weight.numel() >= MIN_SHARE * total]
    split: list[str] = []
    whole: list[tuple[str, str]] = []
    for path in big:
        try:
            _embedding(gm, path, modules[path], world)
        except VocabParallelError as exc:
            if strict:
                raise
            whole.append((path, str(exc)))
            continue
        split.append(path)
    vocab = {modules[p].weight.shape[0] for p in split}
    heads = [p for p, m in modules.items() if type(m) is nn.Linear and p not in taken and m.out_features in vocab
             and m.weight.numel() >= MIN_SHARE * total and not _shared_with(gm, p, m.weight)]
    return VocabLayers(tuple(split), tuple(heads), tuple(whole))
