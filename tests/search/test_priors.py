"""The sensitivity prior: allocations and per-layer restrictions from a SensitivityInfo, and a tiny search
that measures sensitivity once per study, enqueues the allocations first and reuses the stored measurement."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.passes.analysis.sensitivity_types import GroupSensitivity, LayerSensitivity, SensitivityInfo
from fxforge.passes.base import PASSES
from fxforge.search import MixedPrecisionSpace, PruningSpace, Search, SearchError, TensorTask
from fxforge.search.priors import BIT_BUDGETS, SENSITIVITY_ATTR, SENSITIVITY_PASS, SPARSITY_BUDGETS, allocate
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
    total = sum(space.layer_params.values())
    return sum(config[k]["config"]["weight_width"] * n for k, n in space.layer_params.items()) / total


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


def test_pruning_prior_allocations_fit_sparsity_budgets(setup) -> None:
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
    # bound to a graph, a group weighs the weights of its measured groups' layers (TinyMLP's fc1: 8 x 16)
    mg, _ = setup
    fc1 = GroupSensitivity("fc1", "ffn", 16, (1.0,) * 16, ((0.25, 0.0), (0.5, 0.0), (0.75, 0.0)), ("fc1",))
    bound = PruningSpace([0.0, 0.25, 0.5, 0.75], granularity="ffn", prior="sensitivity")
    assert bound.with_sensitivity(SensitivityInfo("fisher", 0.5, (), (fc1,)), mg).group_params == {"linear": 128}


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


def test_config_space_section_takes_the_prior(tmp_path: Path) -> None:
    """A TOML config's [space] gives prior / loss_bound to the space search/config.py builds (space_from_spec);
    a misspelled prior is refused before the model or the data are loaded."""
    from fxforge.search import load_config, search_from_config

    path = tmp_path / "search.toml"
    path.write_text('[search]\nstudy_name = "p"\nobjectives = ["weight_bits"]\n[model]\nname = "tiny-bert"\n'
                    '[task]\ncalibration_size = 8\n[space]\nkind = "precision"\nper = "layer"\n'
                    'prior = "sensitivity"\nloss_bound = 0.5\n[space.formats.integer]\nwidth = [4, 8]\n'
                    'frac_width = ["auto"]\n')
    config = load_config(path)
    space = space_from_spec(config["space"])
    assert (space.prior, space.loss_bound) == ("sensitivity", 0.5)
    config["space"]["prior"] = "sensitivty"
    with pytest.raises(SearchError, match="unknown prior 'sensitivty'"):
        search_from_config(config, output_root=tmp_path)


def test_prior_without_calibration_data_refused_before_any_study(setup, tmp_path: Path) -> None:
    mg, _ = setup
    plain = tiny_search_setup(32)[1]  # no calibration batches
    for task in (plain, None):
        with pytest.raises(SearchError, match="calibration"):
            Search(_space(), ["avg_weight_bits"], base=mg, task=task, run_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())


# -- a tiny search with the real pass ------------------------------------------------------------------------
@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the registered sensitivity_analysis_pass, counted."""
    real, calls = PASSES[SENSITIVITY_PASS], []

    def counting(graph, pass_args=None):
        calls.append(1)
        return real(graph, pass_args)

    monkeypatch.setitem(PASSES, SENSITIVITY_PASS, counting)
    return calls


def _search(setup, run_dir: Path, n_trials: int, resume: bool = False, **kw) -> Search:
    mg, task = setup
    return Search(_space(loss_bound=1e-4), ["accuracy", "avg_weight_bits"], base=mg, task=task, n_trials=n_trials,
                  sampler="random", run_dir=run_dir, resume=resume, progress=False, seed=0, **kw)


def test_search_measures_once_enqueues_allocations_first_and_reuses_on_resume(setup, counted, tmp_path: Path) -> None:
    first = _search(setup, tmp_path, 5).run()
    assert len(counted) == 1
    stored = SensitivityInfo.from_json(first.study.user_attrs[SENSITIVITY_ATTR])
    assert {layer.name for layer in stored.layers} == {"fc1", "fc2"}
    shaped = _space(loss_bound=1e-4).bind(setup[0]).with_sensitivity(stored)
    expected = shaped.prior_allocations()
    trials = first.study.trials
    assert [t.params for t in trials[:len(expected)]] == expected  # no hand-written enqueue
    for t in trials:  # every trial, enqueued or sampled, keeps its layers' weights within the bound
        for layer, allowed in shaped.widths_by_layer.items():
            assert t.params.get(f"{layer}:integer:weight_width", allowed[0]) in allowed
    resumed = _search(setup, tmp_path, 8, resume=True).run()
    assert len(counted) == 1  # read back from the study, not measured again
    assert len(resumed.study.trials) == 8
    assert [t.params for t in resumed.study.trials[:len(expected)]] == expected  # not enqueued twice


def test_given_enqueue_outside_the_shaped_space_refused_before_any_trial(setup, counted, tmp_path: Path) -> None:
    """A hand-written enqueue fits the unshaped space (checked when the Search is made) but is checked again
    once the prior has restricted the widths: one no layer is left is refused before any trial runs."""
    study = _search(setup, tmp_path, 1).run().study
    stored = SensitivityInfo.from_json(study.user_attrs[SENSITIVITY_ATTR])
    shaped = _space(loss_bound=1e-4).bind(setup[0]).with_sensitivity(stored)
    layer, allowed = next((k, v) for k, v in shaped.widths_by_layer.items() if len(v) < len(WIDTHS))
    removed = next(w for w in WIDTHS if w not in allowed)
    params = {f"{k}:integer:{role}_width": 8 for k in ("fc1", "fc2") for role in ("data_in", "weight")}
    params[f"{layer}:integer:weight_width"] = removed
    search = _search(setup, tmp_path, 3, resume=True, enqueue=[params])  # fits the unshaped space
    with pytest.raises(SearchError, match="enqueue"):
        search.run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 1


@pytest.mark.parametrize("edit", ["not an object", {"layers": [{"name": "fc1", "params": -5, "quant": [[8, "x"]]}]},
                                  {"baseline_loss": float("nan")}])
def test_hostile_stored_sensitivity_refused_on_resume(setup, counted, tmp_path: Path, edit) -> None:
    """A study's attribute edited (wrong types, NaN, another model's layers) stops the resume before any trial."""
    study = _search(setup, tmp_path, 1).run().study
    stored = study.user_attrs[SENSITIVITY_ATTR]
    study.set_user_attr(SENSITIVITY_ATTR, {**stored, **edit} if isinstance(edit, dict) else edit)
    with pytest.raises(SearchError, match="stored sensitivity .* is invalid|no layer 'fc1'"):
        _search(setup, tmp_path, 3, resume=True).run()
    assert len([t for t in study.trials if t.state.is_finished()]) == 1 and len(counted) == 1


@pytest.mark.slow_search  # 16-54 s on the shared machine: the pass on BERT (first per-sample gradients) and 2 trials
def test_pruning_prior_on_tiny_bert_enqueues_head_and_ffn_allocations(counted, tmp_path: Path) -> None:
    """Tiny BERT's attention heads and FFN units measured once; the first trials are the allocations, each
    sparsity within the group's allowed ones, on the space's own parameter names."""
    from conftest import make_tiny_bert

    torch.manual_seed(0)
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    ids, calib = torch.randint(0, 100, (8, 16)), torch.randint(0, 100, (4, 16))
    with torch.no_grad():
        labels, calib_labels = (mg.model(input_ids=x, attention_mask=torch.ones_like(x)).logits.argmax(-1)
                                for x in (ids, calib))
    task = TensorTask({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels, batch_size=16,
                      calibration=({"input_ids": calib, "attention_mask": torch.ones_like(calib)}, calib_labels))
    space = PruningSpace([0.0, 0.25, 0.5], groups={"attn": {"name": ["query", "key", "value"]},
                                                   "mlp": {"name": ["intermediate.dense"]}},
                         granularity={"attn": "head", "mlp": "ffn"}, prior="sensitivity")
    search = Search(space, ["accuracy"], base=mg, task=task, n_trials=2, sampler="random", run_dir=tmp_path,
                    progress=False)
    study = search.run().study
    assert len(counted) == 1
    info = SensitivityInfo.from_json(study.user_attrs[SENSITIVITY_ATTR])
    assert {g.kind for g in info.groups} == {"heads", "ffn"}
    expected = space.with_sensitivity(info, mg).prior_allocations()
    assert [t.params for t in study.trials[:len(expected)]] == expected
    shaped = search._bound
    assert all(set(p) == {"sparsity:attn", "sparsity:mlp"} for p in expected)
    assert all(p[f"sparsity:{g}"] in shaped.sparsity_by_group[g] for p in expected for g in ("attn", "mlp"))
