"""TextClassificationTask training: a progress bar while it trains, no metric dicts printed after it."""

from __future__ import annotations

import pytest

from fxforge import ForgeGraph
from fxforge.models.bert import tiny_bert
from fxforge.search import TextClassificationTask

HF_NAMES = ["input_ids", "attention_mask", "labels"]


@pytest.mark.parametrize("progress", [True, False])
def test_training_prints_no_metric_dicts(progress: bool, capfd: pytest.CaptureFixture[str]) -> None:
    task = TextClassificationTask(train_size=32, eval_size=16, max_length=16, eval_batch_size=16, progress=progress,
                                  train_args={"max_steps": 2, "per_device_train_batch_size": 16,
                                              "learning_rate": 1e-3, "training_args": {"logging_steps": 1}})
    graph = ForgeGraph(tiny_bert(hidden_size=16, intermediate_size=32), hf_input_names=HF_NAMES)
    before = [p.detach().clone() for p in graph.model.parameters()]
    capfd.readouterr()
    task.train(graph, None)
    out, err = capfd.readouterr()
    assert any(not p.equal(b) for p, b in zip(graph.model.parameters(), before))  # it did train
    for noise in ("'loss'", "train_runtime", "eval_accuracy"):  # logged every step and at the end: not printed
        assert noise not in out + err
    assert ("2/2" in err) == progress  # the bar, when asked for
