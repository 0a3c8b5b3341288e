"""The two quantization examples' main() end to end with tiny settings: the rows they report are the ones
they write, and the mixed-precision search exports a point that reloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fxforge import ForgeGraph


def test_quantization_example_writes_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PTQ rows for one fixed-point width and the three 8-bit formats, then both real int8 lowerings, timed."""
    from fxforge.examples.quantization import main

    out = tmp_path / "rows.json"
    main(["--train", "16", "--test", "16", "--length", "16", "--epochs", "1", "--widths", "8", "--no-qat",
          "--calib-batches", "1", "--rounds", "1", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
          "--json", str(out)])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["-"] + ["PTQ"] * 4 + ["real int8"] * 2
    assert rows[0]["config"] == "fp32"
    for r in rows:  # each printed table row is the written one
        assert f"| {r['config']} | {r['method']} | {100 * r['accuracy']:.1f} |" in text
    ptq = {r["config"]: r for r in rows if r["method"] == "PTQ"}
    assert ptq["MXINT8"]["weight_bits"] < 9 and ptq["FP8 E4M3"]["weight_bits"] == 8
    assert all(r["output_sqnr_db"] > 10 for r in ptq.values())  # 8-bit formats keep the logits close
    assert all(r["int8_ms"] > 0 and r["fp32_ms"] > 0 for r in rows if r["method"] == "real int8")


@pytest.mark.slow  # 22 s: a real mixed-precision search
def test_search_mixed_precision_example_searches_and_exports(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Two trials (the uniform 8- and 6-bit points it queues first) on 16 reviews: the Pareto files exist and
    the exported best point reloads with quantized layers."""
    from fxforge.examples.search_mixed_precision import main

    run = tmp_path / "mp"
    assert main(["--trials", "2", "--train-size", "16", "--eval-size", "16", "--run-dir", str(run)]) == 0
    text = capsys.readouterr().out
    assert len(re.findall(r"integer \d/(?:\d|auto) everywhere: accuracy", text)) == 6
    assert (run / "pareto.csv").is_file() and json.loads((run / "pareto.json").read_text())["front"]
    best = ForgeGraph.from_checkpoint(next((run / "best").iterdir()))
    assert any(r.name == "quantize_transform_pass" for r in best.history)


@pytest.mark.slow  # MiniLM fine-tuned on 16 reviews, its sensitivity measured, two trials
def test_search_mixed_precision_tutorial6_with_the_prior(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tutorial 6's pairs with the sensitivity prior: the uniform 16- and 8-bit rows, and the search's front
    compared with both."""
    from fxforge.examples.search_mixed_precision import main

    run = tmp_path / "mp6"
    assert main(["--choices", "tutorial6", "--prior", "sensitivity", "--trials", "2", "--train-size", "16",
                 "--eval-size", "16", "--max-length", "16", "--calibration-size", "8", "--run-dir", str(run)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"integer 16/8 everywhere: accuracy [0-9.]+", text) and "integer 8/4 everywhere" in text
    assert re.search(r"uniform 8-bit accuracy [0-9.]+ at [0-9.]+ avg weight bits, uniform 16-bit accuracy", text)
    assert re.search(r"trial \d+: accuracy [0-9.]+ at [0-9.]+ bits; .* vs uniform 16-bit", text), text
