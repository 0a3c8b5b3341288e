"""The mixed-precision example's pieces on a tiny BERT: its uniform "auto" configuration calibrates and keeps
the logits close, and its default per-layer choices (fraction widths from the range) warn about nothing."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import bert_inputs, logits, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.examples.search_mixed_precision import CHOICES, uniform
from fxforge.passes.quantize import QuantizationWarning, quantization_report_analysis_pass
from fxforge.pipelines import Pipeline
from fxforge.search import MixedPrecisionSpace


def test_uniform_auto_calibrates_and_the_default_choices_keep_every_layer() -> None:
    base = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    calib = [bert_inputs(batch=4, seq=12) for _ in range(2)]
    steps = uniform(8, "auto", calib)
    assert [s[0] for s in steps] == ["quantize_transform_pass", "calibrate_transform_pass"]
    graph, _ = Pipeline(steps, name="uniform 8/auto", verify=False)(base)
    x = bert_inputs(batch=3, seq=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        _, rep = quantization_report_analysis_pass(graph, {"data": [x]})
        MixedPrecisionSpace({"integer": CHOICES["auto"]}, roles=("data_in", "weight"), per="layer").bind(base)
    assert rep["weight_zero_fraction"] < 0.03 and rep["output_sqnr_db"] > 45.0  # measured 0.010 and 62 dB
    assert (logits(graph, x) - logits(base, x)).abs().max() < 0.005  # measured 0.0004
    assert not torch.equal(logits(graph, x), logits(base, x))


def test_tutorial6_pairs_with_the_sensitivity_prior_search_and_compare(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Tutorial 6's (width, frac_width) pairs for inputs, weights and biases per layer, with the sensitivity prior:
    the first trial is the prior's allocation (every weight width one the prior kept for its layer, fraction
    widths among the space's), and the comparison prints each front point against the uniform 8- and 16-bit."""
    from fxforge.examples.search_mixed_precision import ROLES, TUTORIAL6, compare
    from fxforge.search import Search, TensorTask

    base = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    x = bert_inputs(batch=8, seq=10)
    labels = logits(base, x).argmax(-1)  # the float model's own answers: the search measures what quantizing costs
    x = {k: v for k, v in x.items() if k != "labels"}
    task = TensorTask(x, labels, calibration=(x, labels))
    space = MixedPrecisionSpace({"integer": TUTORIAL6}, roles=ROLES["tutorial6"], per="layer", prior="sensitivity")
    result = Search(space, ["accuracy", "avg_weight_bits"], base=base, task=task, n_trials=1, run_dir=tmp_path,
                    progress=False).run()
    trial = result.completed()[0]
    shaped = result.search._bound  # the space as the prior shaped it
    widths = {k: v for k, v in trial.params.items() if k.endswith(":integer:weight_width")}
    assert len(widths) == 14 and set(widths.values()) <= set(TUTORIAL6["width"])
    assert all(w in shaped.widths_by_layer[k.split(":")[0]] for k, w in widths.items())
    fracs = [v for k, v in trial.params.items() if "frac_width" in k]
    assert fracs and set(fracs) <= set(TUTORIAL6["frac_width"])
    compare(result, 1.0, {(8, 4): (0.9, 8.0), (16, 8): (1.0, 16.0)})
    text = capsys.readouterr().out
    assert "uniform 8-bit accuracy 0.900 at 8.00" in text and "uniform 16-bit accuracy 1.000 at 16.00" in text
    assert re.search(r"trial 0: accuracy [0-9.]+ at [0-9.]+ bits; [-+][0-9.]+ points and [-+][0-9.]+ bits vs uniform "
                     r"8-bit, [-+][0-9.]+ points and [-+][0-9.]+ bits vs uniform 16-bit", text), text
