"""NAS end to end on a tiny BERT over offline IMDb: real config fields, training through get_trainer,
pruners fed with intermediate accuracy, the best configuration rebuilt and exported."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from fxforge import ForgeGraph
from fxforge.search import NASSpace, Search, TextClassificationTask

HF_NAMES = ["input_ids", "attention_mask", "labels"]


@pytest.fixture(scope="module")
def task() -> TextClassificationTask:
    return TextClassificationTask(train_size=64, eval_size=32, max_length=32, eval_batch_size=16,
                                  progress=False, train_args={"max_steps": 4, "per_device_train_batch_size": 16,
                                              "learning_rate": 1e-3}, report_every=2)


SPACE = NASSpace("BertConfig", {"num_hidden_layers": [1, 2], "hidden_size": [16, 24], "num_attention_heads": [2, 3]},
                 base={"vocab_size": 30522, "intermediate_size": 32, "max_position_embeddings": 64})


def test_nas_trials_build_train_and_rebuild(task: TextClassificationTask, tmp_path: Path) -> None:
    result = Search(SPACE, ["accuracy", "param_count"], task=task, n_trials=3, sampler="random",
                    capture={"hf_input_names": HF_NAMES}, run_dir=tmp_path, progress=False).run()
    states = [t.state for t in result.study.trials]
    pruned = [t for t in result.study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert states.count(optuna.trial.TrialState.COMPLETE) + len(pruned) == 3
    for t in result.completed():  # the sampled sizes really took effect
        layers, hidden = t.params["num_hidden_layers"], t.params["hidden_size"]
        assert hidden % t.params["num_attention_heads"] == 0
        embed = 30522 * hidden
        assert t.values[1] > embed and (layers == 2) == (t.values[1] > embed + 2 * 4 * hidden * hidden)
        assert 0.0 <= t.values[0] <= 1.0
    for t in pruned:  # pruned before training: a head split the model cannot build
        assert t.params["hidden_size"] % t.params["num_attention_heads"]
    best = result.front()[0]
    graph = result.rebuild(best)
    assert isinstance(graph, ForgeGraph)
    assert sum(p.numel() for p in graph.model.parameters()) == best.values[1]


def test_median_pruner_is_fed_intermediate_accuracy(task: TextClassificationTask, tmp_path: Path) -> None:
    result = Search(SPACE, ["accuracy"], task=task, n_trials=3, sampler="random", pruner="median", seed=1,
                    capture={"hf_input_names": HF_NAMES}, run_dir=tmp_path, progress=False).run()
    trained = [t for t in result.study.trials if t.intermediate_values]
    assert trained and all(set(t.intermediate_values) <= {2, 4} for t in trained)
    with pytest.raises(Exception, match="pruners need a single objective"):
        Search(SPACE, ["accuracy", "param_count"], task=task, pruner="median", run_dir=tmp_path / "x")


def test_base_may_set_config_properties_like_num_labels() -> None:
    """``num_labels`` is a BertConfig property (stored as id2label, absent from to_dict()): the NAS example
    sets it in ``base``; it is accepted and takes effect, while a name no config knows is still refused."""
    space = NASSpace("BertConfig", {"num_hidden_layers": [1]},
                     base={"vocab_size": 64, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 8,
                           "max_position_embeddings": 16, "num_labels": 3})
    model = space.build_model({"num_hidden_layers": 1}, ())
    assert model.classifier.out_features == 3 and model.config.num_labels == 3
    with pytest.raises(Exception, match=r"no field\(s\) \['num_labelz'\].*similar fields: \[.*'num_labels'"):
        NASSpace("BertConfig", {"num_hidden_layers": [1]}, base={"num_labelz": 2})
    with pytest.raises(Exception, match=r"no field\(s\) \['num_layers'\]"):
        NASSpace("BertConfig", {"num_layers": [1, 2]})
