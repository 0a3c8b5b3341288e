"""Search spaces: real HF field names, validated choices, invalid combinations pruned before training."""

from __future__ import annotations

import optuna
import pytest

from fxforge.search import (
    JointSpace,
    LoRARankSpace,
    MixedPrecisionSpace,
    NASSpace,
    PruningSpace,
    SearchError,
    space_from_spec,
)


def _trial(params: dict | None = None) -> optuna.Trial:
    study = optuna.create_study()
    if params:
        study.enqueue_trial(params)
    return study.ask()


def test_nas_space_refuses_fields_bert_config_does_not_have() -> None:
    with pytest.raises(SearchError, match=r"BertConfig has no field\(s\) \['num_heads', 'num_layers'\]"):
        NASSpace("BertConfig", {"num_layers": [2, 4], "num_heads": [2, 4]})
    with pytest.raises(SearchError, match="choices must be a non-empty list"):
        NASSpace("BertConfig", {"num_hidden_layers": []})
    with pytest.raises(SearchError, match="not a transformers PretrainedConfig class"):
        NASSpace("os", {"num_hidden_layers": [1]})


def test_nas_space_prunes_indivisible_heads_and_builds_real_sizes() -> None:
    space = NASSpace("BertConfig", {"hidden_size": [24, 32], "num_attention_heads": [3, 4],
                                    "num_hidden_layers": [1, 2]},
                     base={"vocab_size": 50, "intermediate_size": 16, "max_position_embeddings": 32})
    with pytest.raises(optuna.TrialPruned, match="hidden_size 32 is not divisible by num_attention_heads 3"):
        space.suggest(_trial({"hidden_size": 32, "num_attention_heads": 3, "num_hidden_layers": 1}))
    plan = space.suggest(_trial({"hidden_size": 24, "num_attention_heads": 3, "num_hidden_layers": 2}))
    assert plan.train and dict(plan.model_config) == {"hidden_size": 24, "num_attention_heads": 3,
                                                      "num_hidden_layers": 2}
    model = space.build_model(plan.model_config, ())
    assert model.config.num_hidden_layers == 2 and len(model.bert.encoder.layer) == 2
    assert model.bert.encoder.layer[0].attention.self.query.out_features == 24


def test_nas_identity_only_where_shapes_fit() -> None:
    space = NASSpace("BertConfig", {"num_hidden_layers": [1]}, identity=[r".*attention\.output\.dense",
                                                                         r".*output\.dense"],
                     base={"vocab_size": 50, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32})
    cands = space.identity_candidates({"num_hidden_layers": 1})
    assert cands == ["bert.encoder.layer.0.attention.output.dense"]  # FFN output dense is 32 -> 16: excluded
    plan = space.suggest(_trial({"num_hidden_layers": 1, f"identity:{cands[0]}": "identity"}))
    assert plan.identity_layers == tuple(cands)
    model = space.build_model(plan.model_config, plan.identity_layers)
    assert type(model.bert.encoder.layer[0].attention.output.dense).__name__ == "Identity"


def test_precision_space_validates_and_prunes_bad_widths() -> None:
    with pytest.raises(SearchError, match="unknown quantization format 'float4'"):
        MixedPrecisionSpace({"float4": {"width": [4]}})
    with pytest.raises(SearchError, match=r"has no parameter\(s\) \['bits'\]"):
        MixedPrecisionSpace({"integer": {"bits": [4]}})
    with pytest.raises(SearchError, match="choices must be a non-empty list"):
        MixedPrecisionSpace({"integer": {"width": [], "frac_width": [2]}})
    with pytest.raises(SearchError, match="no combination of the 'integer' choices"):
        MixedPrecisionSpace({"integer": {"width": [2, 3], "frac_width": [4, 5]}})
    space = MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 6]}}, roles=("weight",))
    narrow = space.suggest(_trial({"linear:integer:weight_width": 4}))  # 6 fraction bits do not fit in 4
    assert narrow.steps[0][1]["linear"]["config"] == {"name": "integer", "weight_width": 4, "weight_frac_width": 2}
    plan = space.suggest(_trial({"linear:integer:weight_width": 8, "linear:integer:weight_frac_width": 6}))
    (name, config), = plan.steps
    assert name == "quantize_transform_pass"
    assert config["linear"]["config"] == {"name": "integer", "weight_width": 8, "weight_frac_width": 6}


def test_per_layer_fixed_point_space_samples_only_valid_widths(bert_graph) -> None:
    """MASE's tutorial space (widths and fraction widths drawn independently) is almost never valid over
    every layer at once: 0.76 per layer and role. Fraction widths are drawn from what the width admits."""
    from fxforge.passes.quantize import QuantizationWarning
    from fxforge.search.precision import TUTORIAL_FIXED_POINT  # the tutorial 6/10 example's choices

    space = MixedPrecisionSpace({"integer": TUTORIAL_FIXED_POINT}, roles=("data_in", "weight"), per="layer")
    with pytest.warns(QuantizationWarning, match="14 layer"):  # tiny BERT's weights (std 0.02) are below 1/64
        space = space.bind(bert_graph)
    assert len(space.keys()) >= 8
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen: dict[int, set[int]] = {}
    for _ in range(20):
        trial = study.ask()
        config = space.suggest(trial).steps[0][1]  # never pruned
        for key in space.keys():
            entry = config[key]["config"]
            for role in ("data_in", "weight"):
                width, frac = entry[f"{role}_width"], entry[f"{role}_frac_width"]
                assert frac <= width
                seen.setdefault(width, set()).add(frac)
        study.tell(trial, 0.0)
    assert seen == {2: {1, 2}, 3: {1, 2, 3}, 4: {1, 2, 3, 4}, 6: {1, 2, 3, 4, 5}, 8: {1, 2, 3, 4, 5}}
    names = set(study.trials[0].params)
    assert f"{space.keys()[0]}:integer:weight_frac_width|width=3" in {n for t in study.trials for n in t.params}
    assert all(n.endswith(("_width", "|width=2", "|width=3", "|width=4")) for n in names)


def test_joint_space_orders_steps_and_round_trips_its_spec() -> None:
    joint = JointSpace(MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [4]}}),
                       LoRARankSpace([4, 8]), PruningSpace([0.5], method="l1"))
    plan = joint.suggest(_trial({"lora:rank": 4, "sparsity:linear": 0.5}))
    assert [s[0] for s in plan.steps] == ["prune_transform_pass", "insert_lora_adapter_transform_pass",
                                          "fuse_lora_weights_transform_pass", "quantize_transform_pass"]
    assert [s[0] for s in plan.before_training()] == ["prune_transform_pass", "insert_lora_adapter_transform_pass"]
    assert plan.train
    again = space_from_spec(joint.to_spec())
    assert again.to_spec() == joint.to_spec()
    assert again.suggest(_trial({"lora:rank": 4, "sparsity:linear": 0.5})).key() == plan.key()
    with pytest.raises(SearchError, match="unknown space kind 'bogus'"):
        space_from_spec({"kind": "bogus"})
    with pytest.raises(SearchError, match=r"unknown key\(s\) \['rnak'\]"):
        space_from_spec({"kind": "lora", "rnak": [4]})
    with pytest.raises(SearchError, match=r"sparsity choices must be in \[0, 1\)"):
        PruningSpace([1.0])


def test_pruning_space_granularity_per_group() -> None:
    groups = {"ffn": {"regex": [r".*intermediate\.dense"]}, "heads": {"regex": [r".*self\.(query|key|value)"]}}
    space = PruningSpace([0.0, 0.5], groups=groups, granularity={"ffn": "ffn", "heads": "head"}, shrink=True)
    plan = space.suggest(_trial({"sparsity:ffn": 0.5, "sparsity:heads": 0.5}))
    assert [(n, a["weight"]["granularity"]) for n, a in plan.steps if n == "prune_transform_pass"] == \
        [("prune_transform_pass", "ffn"), ("prune_transform_pass", "head")]
    assert plan.steps[-1][0] == "shrink_transform_pass"
    dense = space.suggest(_trial({"sparsity:ffn": 0.0, "sparsity:heads": 0.0}))
    assert dense.steps == ()
    assert space_from_spec(space.to_spec()).to_spec() == space.to_spec()
    with pytest.raises(SearchError, match=r"unknown group\(s\) \['attn'\], missing \['heads'\]"):
        PruningSpace([0.5], groups=groups, granularity={"ffn": "ffn", "attn": "head"})
    with pytest.raises(SearchError, match="granularity must be one of"):
        PruningSpace([0.5], groups=groups, granularity={"ffn": "ffn", "heads": "heads"})
    with pytest.raises(SearchError, match="shrink needs a structured granularity"):
        PruningSpace([0.5], groups=groups, granularity={"ffn": "ffn", "heads": "elementwise"}, shrink=True)


def test_qat_moves_quantization_before_the_fine_tune_and_refuses_lora() -> None:
    precision = MixedPrecisionSpace({"mxint": {"width": [4]}}, roles=("weight",), qat=True)
    pruning = PruningSpace([0.5], groups={"ffn": {"regex": [r".*intermediate\.dense"]}}, granularity="ffn",
                           shrink=True, finetune=True)
    plan = JointSpace(pruning, precision).suggest(_trial({"sparsity:ffn": 0.5}))
    assert plan.qat and plan.train
    assert [s[0] for s in plan.before_training()] == ["prune_transform_pass", "shrink_transform_pass",
                                                      "quantize_transform_pass"]
    assert plan.after_training() == ()
    ptq = JointSpace(pruning, MixedPrecisionSpace({"mxint": {"width": [4]}}, roles=("weight",)))
    ptq_plan = ptq.suggest(_trial({"sparsity:ffn": 0.5}))
    assert [s[0] for s in ptq_plan.after_training()] == ["quantize_transform_pass"]
    assert ptq_plan.key() != plan.key()  # same steps, different order: evaluated separately
    alone = precision.suggest(_trial())
    assert alone.train and [s[0] for s in alone.before_training()] == ["quantize_transform_pass"]
    spec = JointSpace(pruning, precision).to_spec()
    assert space_from_spec(spec).to_spec() == spec and spec["spaces"][1]["qat"] is True
    assert "qat" not in ptq.to_spec()["spaces"][1]  # studies stored before the option keep their spec
    with pytest.raises(SearchError, match="precision qat=True with a LoRA space.*cannot be combined with LoRA"):
        JointSpace(precision, LoRARankSpace([4]))


def test_precision_space_warns_when_its_finest_fixed_point_zeroes_minilm_weights(minilm_classifier) -> None:
    """The README's former space (fraction widths 2 and 3) rounds most of MiniLM's weights to 0 at every width:
    bound to the graph, it says so before any trial; with fraction widths chosen from the range it does not."""
    import copy
    import warnings

    from fxforge import ForgeGraph
    from fxforge.passes.quantize import QuantizationWarning
    from fxforge.search.precision import AUTO_FIXED_POINT

    graph = ForgeGraph(copy.deepcopy(minilm_classifier), hf_input_names=["input_ids", "attention_mask"]).eval()
    old = MixedPrecisionSpace({"integer": {"width": [4, 6, 8], "frac_width": [2, 3]}}, roles=("data_in", "weight"))
    with pytest.warns(QuantizationWarning, match=r"even its finest choice.*mostly round to zero.*'auto'") as seen:
        old.bind(graph)
    count = int(str(seen[0].message).split("the weights of ")[1].split(" layer")[0])
    assert count >= 30  # measured: 37 of MiniLM's 38 linear layers (value projections: 83% zero at frac 3)
    auto = MixedPrecisionSpace({"integer": AUTO_FIXED_POINT}, roles=("data_in", "weight"), per="layer")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        bound = auto.bind(graph)
    assert len(bound.keys()) == 38


def test_auto_activation_fraction_widths_get_a_calibration_step_with_the_task_data(bert_graph) -> None:
    import torch
    from conftest import bert_inputs

    from fxforge.search import TensorTask
    from fxforge.search.runner import calibrated

    space = MixedPrecisionSpace({"integer": {"width": [8], "frac_width": ["auto", 4]}}, roles=("data_in", "weight"))
    auto = space.suggest(_trial({"linear:integer:data_in_frac_width": "auto",
                                 "linear:integer:weight_frac_width": 4}))
    assert [s[0] for s in auto.steps] == ["quantize_transform_pass", "calibrate_analysis_pass"]
    fixed = space.suggest(_trial({"linear:integer:data_in_frac_width": 4, "linear:integer:weight_frac_width": "auto"}))
    assert [s[0] for s in fixed.steps] == ["quantize_transform_pass"]  # weights take their range from themselves
    assert space_from_spec(space.to_spec()).to_spec() == space.to_spec()
    x, y = bert_inputs(batch=4, labels=False), torch.zeros(4, dtype=torch.long)
    steps = calibrated(auto.steps, TensorTask(x, y, calibration=(x, y), batch_size=2), bert_graph)
    assert [b["input_ids"].shape[0] for b in steps[1][1]["data"]] == [2, 2]  # the task's calibration batches
    assert all(torch.equal(b["labels"], y[:2]) for b in steps[1][1]["data"])
    assert calibrated(auto.steps, TensorTask(x, y), bert_graph)[1][1] == {}  # none: the graph's example inputs
