"""MASE tutorial 4's pruning targets on MiniLM, and the same target through Torch-Pruning (the baseline),
shared by examples/prune_minilm.py and benchmarks/bench_prune.py."""

from __future__ import annotations

import torch
from transformers.models.bert.modeling_bert import (
    BertForSequenceClassification,
    BertOutput,
    BertSelfAttention,
    BertSelfOutput,
)

__all__ = ["ELEMENTWISE", "FFN", "HEADS", "torch_pruning_model"]

ELEMENTWISE = {"weight": {"sparsity": 0.5, "method": "l1", "scope": "global"}}
FFN = {"weight": {"sparsity": 0.5, "method": "l1", "scope": "local", "granularity": "ffn"}}
HEADS = {"weight": {"sparsity": 1 / 3, "method": "l1", "scope": "local", "granularity": "head"}}


def torch_pruning_model(model: torch.nn.Module, example: dict[str, torch.Tensor],
                        calib: list[dict[str, torch.Tensor]] | None = None) -> torch.nn.Module:
    """Torch-Pruning at the same target: 50 % FFN units, 1/3 of heads, hidden size untouched; L1 magnitude,
    or with ``calib`` (batches with labels) its group Taylor importance from the gradients summed over them."""
    import torch_pruning as tp

    if not isinstance(model, BertForSequenceClassification) or model.bert.pooler is None:
        raise TypeError(f"torch_pruning_model prunes a BERT classifier with a pooler (MiniLM's), not a "
                        f"{type(model).__name__}")
    attentions = [m for m in model.modules() if isinstance(m, BertSelfAttention)]
    num_heads = {lin: att.num_attention_heads for att in attentions for lin in (att.query, att.key, att.value)}
    ignored: list[torch.nn.Module] = [model.classifier, model.bert.pooler.dense, model.bert.embeddings]
    ignored += [m.dense for m in model.modules() if isinstance(m, BertSelfOutput | BertOutput)]
    importance: object = tp.importance.MagnitudeImportance(p=1)
    if calib is not None:
        importance = tp.importance.GroupTaylorImportance()
        model.zero_grad()
        with torch.enable_grad():
            for batch in calib:
                model(**batch).loss.backward()
    pruner = tp.pruner.MetaPruner(
        model, example, importance=importance, pruning_ratio=0.5,
        num_heads=num_heads, prune_num_heads=True, prune_head_dims=False, head_pruning_ratio=1 / 3,
        ignored_layers=ignored, output_transform=lambda out: out.logits.sum(), global_pruning=False)
    pruner.step()
    model.zero_grad(set_to_none=True)
    for att in attentions:
        att.num_attention_heads = pruner.num_heads[att.query]
        att.all_head_size = att.query.out_features
    return model
