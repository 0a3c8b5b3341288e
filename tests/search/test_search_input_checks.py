"""Bad search inputs are refused before the first trial, in one message naming the field: a width no
combination admits, a NAS value the model cannot be built with, a malformed storage URL, an unwritable
results path. Nothing is created on disk for a refused search."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_search_setup

from fxforge import ForgeGraph
from fxforge.search import (
    MixedPrecisionSpace,
    NASSpace,
    Search,
    SearchError,
    StorageSpec,
    TensorTask,
    search_from_config,
    space_from_spec,
)


@pytest.fixture(scope="module")
def setup() -> tuple[ForgeGraph, TensorTask]:
    return tiny_search_setup(32)


def test_a_width_no_combination_admits_is_refused_not_dropped() -> None:
    with pytest.raises(SearchError, match=r"integer\.width choice -4 is invalid: .*outside \[2, 32\]"):
        MixedPrecisionSpace({"integer": {"width": [-4, 8], "frac_width": [2]}})
    with pytest.raises(SearchError, match=r"integer\.frac_width.* 12 .*frac_width 12 > width 8"):
        MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 12]}})  # 12 fits no width
    with pytest.raises(SearchError, match=r"integer\.width"):  # from a config's [space] too
        space_from_spec({"kind": "precision", "formats": {"integer": {"width": [-4, 8], "frac_width": [2]}}})
    ok = MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [2, 6]}})  # 6 fits 8 only: kept
    assert ok.formats["integer"]["frac_width"] == (2, 6)


NAS_BASE = {"vocab_size": 64, "intermediate_size": 16, "max_position_embeddings": 16}


def test_a_nas_value_the_model_cannot_take_is_refused_before_any_trial(tmp_path: Path) -> None:
    space = NASSpace("BertConfig", {"hidden_size": [-16], "num_attention_heads": [2]}, base=NAS_BASE)
    with pytest.raises(SearchError, match=r"nas space: hidden_size = -16 .*BertConfig.*negative dimension"):
        Search(space, ["param_count"], n_trials=1, run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # no journal holding a failed trial 0
    mixed = NASSpace("BertConfig", {"hidden_size": [16, 0, 24], "num_attention_heads": [2, 3]}, base=NAS_BASE)
    with pytest.raises(SearchError, match=r"hidden_size = 0 "):
        Search(mixed, ["param_count"], n_trials=1, run_dir=tmp_path / "run", progress=False)
    typed = NASSpace("BertConfig", {"num_hidden_layers": [1, 2.5]}, base={**NAS_BASE, "hidden_size": 8,
                                                                         "num_attention_heads": 2})
    with pytest.raises(SearchError, match=r"num_hidden_layers = 2\.5 "):
        Search(typed, ["param_count"], n_trials=1, run_dir=tmp_path / "run", progress=False)
    # 16 with 3 heads cannot build, but 16 with 2 heads can: a combination the sampler prunes, not refused
    fine = NASSpace("BertConfig", {"hidden_size": [16, 24], "num_attention_heads": [2, 3]}, base=NAS_BASE)
    Search(fine, ["param_count"], n_trials=1, run_dir=tmp_path / "run", progress=False)


@pytest.mark.parametrize("url", ["sqlite:/x.db", "sqlite//x.db", "sqlite:x.db", "postgresql:/host/db",
                                 "sqlite://x.db", "sqlite:///", "sqlite:///dir/"])
def test_a_malformed_storage_url_is_refused_not_taken_as_a_journal_path(setup, tmp_path: Path, url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    mg, task = setup
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SearchError, match="storage .*sqlite:///FILE"):
        StorageSpec(url)
    with pytest.raises(SearchError, match="storage"):
        Search(MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [4]}}), ["accuracy"], base=mg,
               task=task, storage=url, run_dir="run", progress=False)
    config = {"search": {"storage": url, "run_dir": "run"}, "model": {"name": "tiny-bert"},
              "space": {"kind": "precision", "formats": {"integer": {"width": [8], "frac_width": [4]}}}}
    with pytest.raises(SearchError, match="storage"):  # from a config file: not confined as a path either
        search_from_config(config, output_root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no sqlite:/ directory, no run_dir


def test_a_journal_path_that_cannot_be_written_is_refused(setup, tmp_path: Path) -> None:
    mg, task = setup
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "file" / "study.journal", tmp_path):  # under a file; a directory
        with pytest.raises(SearchError, match="storage .*(not a directory|is a directory)"):
            Search(MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [4]}}), ["accuracy"], base=mg,
                   task=task, storage=str(bad), run_dir=tmp_path / "run", progress=False)


def test_an_unwritable_results_path_is_refused_before_the_search_runs(tmp_path: Path) -> None:
    config = tmp_path / "s.toml"
    config.write_text('[search]\nstudy_name = "s"\nn_trials = 1\nrun_dir = "run"\nobjectives = ["weight_bits"]\n'
                      '[model]\nname = "tiny-bert"\n[space]\nkind = "precision"\n'
                      'formats = { integer = { width = [8], frac_width = ["auto"] } }\n')
    (tmp_path / "file").write_text("")
    fxforge = Path(sys.executable).parent / "fxforge"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for results in (tmp_path / "file" / "r.json", tmp_path):
        proc = subprocess.run([str(fxforge), "search", str(config), "--results", str(results)], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=300)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert "--results" in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert not (tmp_path / "run").exists()  # refused before the study (or the model) was made


@pytest.mark.parametrize(("kw", "message"), [
    ({"seed": -1}, r"seed must be None or an integer in \[0, 2\*\*32 - 1\], got -1"),
    ({"seed": 2**32}, r"seed must be None or an integer"),
    ({"seed": True}, r"seed must be None or an integer"),
    ({"timeout": -5}, r"timeout must be None or a positive number of seconds, got -5"),
    ({"study_name": ""}, r"study_name must be a non-empty string"),
    ({"n_trials": 2.5}, r"n_trials must be an integer >= 1, got 2\.5"),
    ({"task": None}, r"objective 'accuracy' needs a task"),
])
def test_run_settings_are_refused_before_anything_is_created(setup, tmp_path: Path, kw: dict, message: str) -> None:
    """Each was accepted and failed later (seed: numpy's ValueError inside trial 0, after the journal was made)
    or ran as given (a negative timeout, an empty study name)."""
    mg, task = setup
    args = {"base": mg, "task": task, "n_trials": 1, "run_dir": tmp_path / "run", "progress": False, **kw}
    with pytest.raises(SearchError, match=message):
        Search(MixedPrecisionSpace({"integer": {"width": [8], "frac_width": [4]}}), ["accuracy"], **args).run()
    assert not (tmp_path / "run").exists()


def test_constraint_and_lora_values_are_checked() -> None:
    from fxforge.search import Constraint, LoRARankSpace

    with pytest.raises(SearchError, match=r"lora alpha choices must be positive numbers, got \[-1\]"):
        LoRARankSpace([4], alpha=[-1])
    with pytest.raises(SearchError, match=r"constraint on 'accuracy': max_drop must be a number >= 0, got -1"):
        Constraint("accuracy", max_drop=-1)
    with pytest.raises(SearchError, match=r"constraint on 'accuracy' needs max_drop, max_value or min_value"):
        Constraint("accuracy")
    with pytest.raises(SearchError, match=r"min_value 2 > max_value 1"):
        Constraint("accuracy", min_value=2, max_value=1)
