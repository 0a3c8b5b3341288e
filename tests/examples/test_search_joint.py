"""The joint-search example's space on a tiny BERT: the hand-picked configurations fit it, and a sampled plan
(FFN units and heads pruned and removed, LoRA, MXINT weights and embedding tables) runs end to end."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.examples.search_joint import space, uniform
from fxforge.passes.quantize.modules import QuantizedEmbedding
from fxforge.search import Search, TensorTask
from fxforge.search.objectives import weight_bits
from fxforge.search.runner import apply_steps, trial_pipeline


def test_joint_space_plan_runs_on_tiny_bert(tmp_path: Path) -> None:
    base = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    inputs = bert_inputs(batch=4, seq=10, labels=False)
    task = TensorTask(inputs, torch.zeros(4, dtype=torch.long))
    search = Search(space(), ["accuracy", "weight_bits"], base=base, task=task, run_dir=tmp_path,
                    enqueue=[uniform(8), uniform(4)], progress=False)
    assert search.enqueue == (uniform(8), uniform(4))
    params = {**uniform(4), "sparsity:ffn": 0.5, "sparsity:heads": 0.25, "lora:rank": 16}
    plan = search._bound.suggest(optuna.trial.FixedTrial(params))
    graph = apply_steps(base.copy(), trial_pipeline(plan.before_training(), "before"))
    graph = apply_steps(graph, trial_pipeline(plan.after_training(), "after"))
    layer = graph.model.get_submodule("bert.encoder.layer.0")
    assert layer.intermediate.dense.out_features == 32  # 64 FFN units, half removed
    assert layer.attention.self.query.out_features == 24  # 4 heads of 8, one removed
    assert sum(isinstance(m, QuantizedEmbedding) for m in graph.model.modules()) == 3
    assert weight_bits(graph) < weight_bits(base) / 7
    for shape in ((4, 10), (2, 7)):
        x = bert_inputs(batch=shape[0], seq=shape[1])
        with torch.no_grad():
            assert graph(**x).logits.shape == (shape[0], 2)
