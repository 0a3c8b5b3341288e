"""The sensitivity prior: allocations and per-layer restrictions from a SensitivityInfo."""

from __future__ import annotations

import optuna
import pytest
import torch
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.passes.analysis.sensitivity_types import GroupSensitivity, LayerSensitivity, SensitivityInfo
from fxforge.search import MixedPrecisionSpace, PruningSpace, SearchError, TensorTask
from fxforge.search.priors import BIT_BUDGETS, SPARSITY_BUDGETS, allocate
from fxforge.search.space import space_from_spec

WIDTHS = [2, 4, 8]


def _space(**kw: object) -> MixedPrecisionSpace:
    return MixedPrecisionSpace({"integer": {"width": WIDTHS, "frac_width": ["auto"]}}, roles=("data_in", "weight"),
                               per="layer", prior="sensitivity", **kw)


def _layer(name: str, params: int, losses: tuple[float, float, float]) -> LayerSensitivity:
    return LayerSensitivity(name, params, tuple(zip((8, 4, 2), losses)))


@pytest.fixture(scope="module")
def setup() -> tuple[ForgeGraph, TensorTask]:
    """TinyMLP (layers fc1: 128 weights, fc2: 48) with calibration batches apart from the evaluation ones."""
    mg, task = tiny_search_setup(64)
    torch.manual_seed(1)
    xc = torch.randn(64, 8)
    with torch.no_grad():
        labels = mg.model(xc).argmax(-1)
    batches = task.eval_batches()
    return mg, TensorTask({"x": torch.cat([b[0]["x"] for b in batches])}, torch.cat([b[1] for b in batches]),
                          batch_size=32, calibration=({"x": xc}, labels))


def _weight_bits(space: MixedPrecisionSpace, params: dict) -> float:
    """Average weight bits of a parameter set (weighted by the layers' parameter counts)."""
    plan = space.suggest(optuna.trial.FixedTrial(params))
    config = dict(plan.steps[0][1])
    total = sum(space._layer_params.values())
    return sum(config[k]["config"]["weight_width"] * n for k, n in space._layer_params.items()) / total


# -- allocation on hand-made sensitivity ---------------------------------------------------------------------
def test_greedy_allocation_respects_capacity_and_prefers_saving_most_loss() -> None:
    options = [[("a8", 8.0, 0.0), ("a2", 2.0, 5.0)], [("b8", 8.0, 0.0), ("b2", 2.0, 0.1)]]
    assert allocate(options, 10.0) == ["a8", "b2"]  # the sensitive item gets the bits
    assert allocate(options, 16.0) == ["a8", "b8"]
    assert allocate(options, 4.0) == ["a2", "b2"]
    assert allocate(options, 3.9) is None  # even the cheapest choices do not fit


def test_precision_prior_allocations_fit_budgets_and_favour_sensitive_layers(setup) -> None:
    mg, _ = setup
    info = SensitivityInfo("fisher", 1.0, (_layer("fc1", 128, (0.0, 0.001, 0.002)),
                                           _layer("fc2", 48, (0.0, 0.02, 0.3))))
    space = _space(loss_bound=10.0).bind(mg).with_sensitivity(info)
    allocs = space.prior_allocations()
    assert len(allocs) >= 2
    bits = [_weight_bits(space, p) for p in allocs]
    assert all(b <= max(BIT_BUDGETS) + 1e-9 for b in bits)
    assert bits == sorted(bits)  # one per budget, tightest first
    for params in allocs:
        # the space's own names, every one sampled (a FixedTrial with a missing or extra name fails)
        trial = optuna.trial.FixedTrial(params)
        space.suggest(trial)
        assert set(trial.params) == set(params)
        # the sensitive fc2 never has fewer weight bits than the insensitive fc1
        assert params["fc2:integer:weight_width"] >= params["fc1:integer:weight_width"]
        assert params["fc1:integer:data_in_width"] == max(WIDTHS)  # activations unmeasured: kept widest
    assert allocs[0]["fc1:integer:weight_width"] == 2  # the tightest budget squeezes the insensitive layer


def test_loss_bound_restricts_widths_per_layer_and_keeps_the_widest(setup) -> None:
    mg, _ = setup
    info = SensitivityInfo("fisher", 0.2, (_layer("fc1", 128, (0.0, 0.01, 0.09)),
                                           _layer("fc2", 48, (5.0, 6.0, 7.0))))
    space = _space().bind(mg).with_sensitivity(info)  # default bound: half the baseline loss, 0.1
    assert space.widths_by_layer == {"fc1": (2, 4, 8), "fc2": (8,)}
    tight = _space(loss_bound=0.05).bind(mg).with_sensitivity(info)
    assert tight.widths_by_layer == {"fc1": (4, 8), "fc2": (8,)}
    trial = optuna.trial.FixedTrial({"fc1:integer:weight_width": 2, "fc1:integer:data_in_width": 8,
                                     "fc2:integer:data_in_width": 8})
    with pytest.raises(ValueError):  # 2 bits is no longer a choice of fc1's weight
        tight.suggest(trial)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        plan = tight.suggest(study.ask())
        assert plan.steps[0][1]["fc2"]["config"]["weight_width"] == 8
        assert plan.steps[0][1]["fc1"]["config"]["weight_width"] in (4, 8)


def test_stored_sensitivity_of_another_model_is_refused(setup) -> None:
    mg, _ = setup
    other = SensitivityInfo("fisher", 1.0, (_layer("encoder.dense", 10, (0.0, 0.1, 0.2)),))
    with pytest.raises(SearchError, match="no layer 'fc1'"):
        _space().bind(mg).with_sensitivity(other)
    narrow = SensitivityInfo("fisher", 1.0, (LayerSensitivity("fc1", 128, ((8, 0.0),)),
                                             LayerSensitivity("fc2", 48, ((8, 0.0),))))
    with pytest.raises(SearchError, match="width 2 was not measured"):
        _space().bind(mg).with_sensitivity(narrow)


def test_pruning_prior_allocations_fit_sparsity_budgets() -> None:
    space = PruningSpace([0.0, 0.25, 0.5, 0.75], groups={"attn": {"type": ["linear"]}, "mlp": {"type": ["linear"]}},
                         granularity={"attn": "head", "mlp": "ffn"}, prior="sensitivity", loss_bound=1.0)
    heads = GroupSensitivity("layer.0.attention", "heads", 4, (1.0,) * 4, ((0.25, 0.5), (0.5, 0.9), (0.75, 2.0)))
    ffn = GroupSensitivity("layer.0.ffn", "ffn", 32, (1.0,) * 32, ((0.25, 0.01), (0.5, 0.02), (0.75, 0.05)))
    shaped = space.with_sensitivity(SensitivityInfo("fisher", 0.5, (), (heads, ffn)), None)
    assert shaped.sparsity_by_group == {"attn": (0.0, 0.25, 0.5), "mlp": (0.0, 0.25, 0.5, 0.75)}
    allocs = shaped.prior_allocations()
    assert allocs and all(set(a) == {"sparsity:attn", "sparsity:mlp"} for a in allocs)
    for budget, params in zip(SPARSITY_BUDGETS, allocs):
        assert (params["sparsity:attn"] + params["sparsity:mlp"]) / 2 >= budget - 1e-9  # equal weights (no graph)
        assert params["sparsity:mlp"] >= params["sparsity:attn"]  # the FFN costs far less loss per unit pruned
    with pytest.raises(SearchError, match="granularity 'head' or 'ffn'"):
        PruningSpace([0.0, 0.5], prior="sensitivity")


# -- spec, config and bad values -----------------------------------------------------------------------------
def test_prior_round_trips_through_spec() -> None:
    for space in (_space(loss_bound=0.25), PruningSpace([0.0, 0.5], granularity="ffn", prior="sensitivity")):
        spec = space.to_spec()
        assert spec["prior"] == "sensitivity"
        assert space_from_spec(spec).to_spec() == spec
    plain = MixedPrecisionSpace({"integer": {"width": WIDTHS, "frac_width": ["auto"]}})
    assert "prior" not in plain.to_spec()  # specs of studies stored before the prior stay equal


@pytest.mark.parametrize(("kw", "match"), [({"prior": "hessian"}, "unknown prior"),
                                           ({"prior": None, "loss_bound": 0.1}, "only applies"),
                                           ({"loss_bound": -1.0}, "positive number"),
                                           ({"per": "type"}, "per='layer'")])
def test_bad_prior_values_refused(kw: dict, match: str) -> None:
    args = {"per": "layer", "prior": "sensitivity", **kw}
    with pytest.raises(SearchError, match=match):
        MixedPrecisionSpace({"integer": {"width": WIDTHS, "frac_width": ["auto"]}}, **args)
    if "per" not in kw:
        args.pop("per")
        with pytest.raises(SearchError, match=match):
            space_from_spec({"kind": "pruning", "sparsity": [0.0, 0.5], "granularity": "ffn", **args})
