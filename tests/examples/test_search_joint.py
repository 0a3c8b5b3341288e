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
from fxforge.search import Search, TensorTask, TextClassificationTask
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


def _distill_setup(lr: float) -> tuple[ForgeGraph, TextClassificationTask]:
    """A tiny BERT and a two-step text task distilled from it (the base is the teacher)."""
    from fxforge.models.bert import tiny_bert

    torch.manual_seed(0)
    base = ForgeGraph(tiny_bert(hidden_size=16, intermediate_size=32), hf_input_names=["input_ids", "attention_mask",
                                                                                       "labels"]).eval()
    task = TextClassificationTask(train_size=32, eval_size=16, max_length=16, eval_batch_size=16, progress=False,
                                  calibration_size=16,
                                  train_args={"max_steps": 2, "per_device_train_batch_size": 16, "learning_rate": lr,
                                              "teacher": base, "distill": {"alpha": 0.5, "temperature": 2.0}})
    return base, task


def test_distill_recipe_prunes_by_taylor_finetunes_distilled_and_rebuilds(tmp_path: Path) -> None:
    """The distill recipe: taylor pruning calibrated on training reviews, every weight fine-tuned from the
    unpruned teacher, then MXINT; the trial's plan trains, and the exported point is rebuilt identically."""
    from fxforge.examples.search_joint import tutorial_pick
    from fxforge.search.runner import PLAN_ATTR, trial_result

    base, task = _distill_setup(lr=1e-3)
    params = uniform(4, "distill", 0.5, 0.25)
    result = Search(space("distill"), ["accuracy", "weight_bits"], base=base, task=task, n_trials=1,
                    run_dir=tmp_path, enqueue=[params], progress=False).run()
    trial = result.completed()[0]
    assert trial.params == params
    measured = trial_result(trial)
    stored = trial.user_attrs[PLAN_ATTR]
    assert measured["values"]["weight_bits"] < result.baseline["weight_bits"] / 7
    rebuilt = result.rebuild(trial)
    layer = rebuilt.model.get_submodule("bert.encoder.layer.0")
    assert layer.intermediate.dense.out_features == 16
    assert task.accuracy(rebuilt) == trial.values[0]  # pruning, distilled fine-tune and quantization replayed
    assert stored["train"] is True
    assert [s[1]["weight"]["method"] for s in stored["steps"] if s[0] == "prune_transform_pass"] == ["taylor"] * 2
    pick = tutorial_pick(base, task, 4)  # uniform 4-bit PTQ: every table and Linear quantized, nothing pruned
    assert sum(isinstance(m, QuantizedEmbedding) for m in pick.model.modules()) == 3
    assert pick.model.get_submodule("bert.encoder.layer.0.intermediate").dense.out_features == 32
    assert weight_bits(base) / 8 < weight_bits(pick) < weight_bits(base) / 7


def test_qat_recipe_quantizes_before_the_distilled_fine_tune_which_trains_through_the_quantizers(
        tmp_path: Path) -> None:
    """The qat recipe: the graph is pruned and quantized before training, the fine-tune then changes the
    quantized layers' weights (straight-through gradients), and the exported point is rebuilt identically."""
    from fxforge.passes.quantize.modules import QuantizedLinear
    from fxforge.search.runner import PLAN_ATTR, plan_pipelines

    base, task = _distill_setup(lr=1e-2)
    params = uniform(4, "qat", 0.5, 0.25, embedding=3)
    search = Search(space("qat"), ["accuracy", "weight_bits"], base=base, task=task, n_trials=1,
                    run_dir=tmp_path, enqueue=[params], progress=False)
    result = search.run()
    trial = result.completed()[0]
    stored = trial.user_attrs[PLAN_ATTR]
    assert stored["qat"] is True and stored["train"] is True
    plan = search._bound.suggest(optuna.trial.FixedTrial(params))
    before, after = plan_pipelines(plan, task, base, "qat")
    assert after is None
    untrained = apply_steps(base.copy(), before)
    name = "bert.encoder.layer.0.intermediate.dense"
    assert isinstance(untrained.model.get_submodule(name), QuantizedLinear)  # quantized before training
    rebuilt = result.rebuild(trial)
    trained = rebuilt.model.get_submodule(name)
    assert isinstance(trained, QuantizedLinear) and trained.out_features == 16
    assert not torch.equal(trained.weight, untrained.model.get_submodule(name).weight)  # trained through it
    assert task.accuracy(rebuilt) == trial.values[0]
    assert trial.values[1] == weight_bits(rebuilt) == weight_bits(untrained)  # training keeps the formats
