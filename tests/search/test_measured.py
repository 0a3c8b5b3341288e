"""Measured objectives on tiny BERT: checkpoint_bytes is the size of the exported checkpoint's weights file
(trial, rebuild and baseline alike), and latency_ms times the lowered model where a lowering applies."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes.quantize.modules import QuantizedLinear
from fxforge.search import MixedPrecisionSpace, Search, SearchError, SearchResult, TensorTask, search_from_config
from fxforge.search.measured import checkpoint_weight_bytes, shipped_latency_ms
from fxforge.search.runner import BASELINE_NOTES_ATTR, trial_result

INT4_WEIGHTS = {"integer": {"width": [4], "frac_width": ["auto"]}}  # fixed point, 4-bit weights (one plan)
INT8_SCALED = {"scaled_integer": {"width": [8], "symmetric": [True], "granularity": ["per_channel"]}}


@pytest.fixture(scope="module")
def base() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()


@pytest.fixture(scope="module")
def task() -> TensorTask:
    inputs = bert_inputs(batch=8, seq=16, labels=True)
    labels = inputs.pop("labels")
    return TensorTask(inputs, labels, batch_size=8)


def _run(base: ForgeGraph, task: TensorTask, tmp: Path, formats: dict[str, Any], objectives: list[str]) -> Any:
    space = MixedPrecisionSpace(formats, roles=("weight",))
    return Search(space, objectives, base=base, task=task, n_trials=1, sampler="random", run_dir=tmp,
                  progress=False).run()


def test_checkpoint_bytes_is_the_exported_weights_file(base: ForgeGraph, task: TensorTask, tmp_path: Path) -> None:
    """A 4-bit-weight trial's value equals the bytes of weights.safetensors in the export of its rebuilt graph
    (and of SearchResult.export), which stores the 4-bit weights packed; the baseline equals the base graph's
    export; notes give the whole directory's size."""
    result = _run(base, task, tmp_path, INT4_WEIGHTS, ["accuracy", "checkpoint_bytes"])
    trial = result.completed()[0]
    value = trial.values[1]
    on_disk = (tmp_path / "rebuilt" / "weights.safetensors")
    result.rebuild(trial).export(tmp_path / "rebuilt")
    assert value == on_disk.stat().st_size == checkpoint_weight_bytes(tmp_path / "rebuilt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = result.export(tmp_path / "front", [trial])[0]
    assert checkpoint_weight_bytes(exported) == value and not [w for w in caught if "bytes of weights" in str(w)]
    base.export(tmp_path / "base")
    assert result.baseline["checkpoint_bytes"] == (tmp_path / "base" / "weights.safetensors").stat().st_size
    # packed: 17,472 of the 23,586 weights are linear weights at 4 bits instead of 32 (measured 44 KB vs 100 KB;
    # the safetensors header of ~80 named tensors and per-row fraction widths come on top of the codes)
    assert value < 0.5 * result.baseline["checkpoint_bytes"]
    table = result.table()  # byte counts in full, the baseline row measured the same way
    assert f"{int(value):,}" in table and f"{int(result.baseline['checkpoint_bytes']):,}" in table
    notes = trial_result(trial)["notes"]["checkpoint_bytes"]
    assert notes["files"] == ["weights.safetensors"]
    assert notes["checkpoint_dir_bytes"] > value  # the graph JSON, metadata and example inputs come on top
    assert result.study.user_attrs[BASELINE_NOTES_ATTR]["checkpoint_bytes"]["files"] == ["weights.safetensors"]


def test_export_warns_when_a_point_is_not_the_size_its_trial_measured(base: ForgeGraph, task: TensorTask,
                                                                     tmp_path: Path) -> None:
    """The study's plan rebuilt on another base graph (a 3-label head) is not what the trial measured: the
    export says so instead of the row's size silently standing for a checkpoint it does not describe."""
    result = _run(base, task, tmp_path, INT4_WEIGHTS, ["checkpoint_bytes"])
    other_base = ForgeGraph(make_tiny_bert(num_labels=3), hf_input_names=["input_ids", "attention_mask"]).eval()
    other = Search(MixedPrecisionSpace(INT4_WEIGHTS, roles=("weight",)), ["checkpoint_bytes"], base=other_base,
                   task=task, n_trials=1, run_dir=tmp_path / "other", progress=False)
    with pytest.warns(UserWarning, match=r"holds \d+ bytes of weights, the trial measured \d+"):
        SearchResult(result.study, result.objectives, result.baseline, other).export(tmp_path / "front")


def test_latency_times_the_lowered_model_when_a_lowering_applies(base: ForgeGraph, task: TensorTask,
                                                                 tmp_path: Path) -> None:
    """8-bit symmetric scaled-integer weights lower to int8 kernels: the trial's latency is timed on a lowered
    copy (the graph measured stays simulated, so its accuracy is the simulated point's); 6-bit minifloat weights
    have no kernel: simulated; the unquantized baseline: float."""
    result = _run(base, task, tmp_path / "a", INT8_SCALED, ["accuracy", "latency_ms"])
    notes = trial_result(result.completed()[0])["notes"]["latency_ms"]
    assert notes == {"timed": "lowered", "lowered": {"int8": 14}, "still_simulated": 0,  # 6 per layer, pooler, head
                     "threads": torch.get_num_threads()}
    rebuilt = result.rebuild(result.completed()[0])
    assert shipped_latency_ms(rebuilt, task).notes["timed"] == "lowered"
    assert not any(type(m).__name__ == "Int8Linear" for m in rebuilt.model.modules())
    assert result.study.user_attrs[BASELINE_NOTES_ATTR]["latency_ms"]["timed"] == "float"
    result = _run(base, task, tmp_path / "b", {"minifloat": {"width": [6], "exponent_width": [3]}},
                  ["accuracy", "latency_ms"])
    notes = trial_result(result.completed()[0])["notes"]["latency_ms"]
    assert notes["timed"] == "simulated" and notes["lowered"] == {} and notes["still_simulated"] == 14
    assert result.completed()[0].values[1] > 0


def test_latency_of_4_bit_weights_times_int4_kernels(base: ForgeGraph, task: TensorTask) -> None:
    """Fixed-point 4-bit weights (power-of-two scale per row) run on the int4 kernel where its packing fits
    the layer (the 2-row classifier takes the int8 one); the timed copy is lowered, the graph given is not."""
    config = {"by": "type", "default": {"config": {"name": None}},
              "linear": {"config": {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"}}}
    graph, _ = passes.quantize_transform_pass(base.copy(), config)
    measured = shipped_latency_ms(graph, task)
    assert measured.notes["timed"] == "lowered" and measured.value > 0
    assert measured.notes["lowered"] == {"int4": 13, "int8": 1}
    assert measured.notes["still_simulated"] == 0
    assert sum(isinstance(m, QuantizedLinear) for m in graph.model.modules()) == 14


def test_config_accepts_the_measured_objectives_and_refuses_misspellings(tmp_path: Path) -> None:
    """[search] objectives may name checkpoint_bytes (and the old weight_bits); a misspelt name is refused
    before anything runs, with the closest built-in name suggested."""
    config: dict[str, Any] = {
        "search": {"study_name": "sizes", "n_trials": 1, "sampler": "random", "run_dir": "run",
                   "objectives": ["checkpoint_bytes", "weight_bits", "latency_ms"]},
        "model": {"name": "tiny-bert"},
        "space": {"kind": "precision", "formats": INT4_WEIGHTS, "roles": ["weight"]},
    }
    search = search_from_config(config, output_root=tmp_path)
    assert [o.name for o in search._objectives] == ["checkpoint_bytes", "weight_bits", "latency_ms"]
    config["search"]["objectives"] = ["accuracy", "checkpoint_byte"]
    with pytest.raises(SearchError, match=r"unknown objective 'checkpoint_byte' \(did you mean 'checkpoint_bytes'"):
        search_from_config(config, output_root=tmp_path)


def test_checkpoint_weight_bytes_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(SearchError, match="no checkpoint weights file"):
        checkpoint_weight_bytes(tmp_path)
