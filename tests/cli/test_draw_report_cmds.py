"""``fxforge draw`` (the report's hierarchy through Graphviz: --depth, --overlay, --flat) and ``fxforge report``'s
sensitivity overlay (--sensitivity-data N measured, --sensitivity FILE read), run in-process on a float tiny BERT
checkpoint; rendering by the real ``dot`` is in tests/report/test_draw_dot.py (marker slow)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.cli.app import main
from fxforge.cli.sensitivity_opts import calibration_batches
from fxforge.graph.inputs import ExampleInputs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ForgeGraph]:
    """A float tiny BERT captured with labels (so the loss methods work too), metadata on, exported."""
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.fxforge"
    mg.export(path)
    return path, mg


def _view(html: Path) -> dict[str, Any]:
    data = re.search(r'<script type="application/json" class="fxg-data">(.*?)</script>', html.read_text(), re.S)
    assert data is not None
    return json.loads(data.group(1))


def _linears(mg: ForgeGraph) -> set[str]:
    return {n.name for n in mg.nodes if n.op == "call_module"
            and isinstance(mg.model.get_submodule(str(n.target)), torch.nn.Linear)}


def test_report_sensitivity_data_colours_every_quantizable_layer(ckpt: tuple[Path, ForgeGraph], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path, mg = ckpt
    html = tmp_path / "r.html"
    assert main(["report", str(path), "-o", str(html), "--sensitivity-data", "2"]) == 0, capsys.readouterr().err
    items = _view(html)["items"]
    measured = {k[2:]: v["values"]["sensitivity"] for k, v in items.items()
                if v["kind"] == "node" and "sensitivity" in v["values"]}
    assert set(measured) == _linears(mg) and len(measured) == 14  # every Linear, named as the graph's nodes
    assert all(math.isfinite(v) and v >= 0 for v in measured.values()) and len(set(measured.values())) > 1
    assert "sensitivity" in items["g:"]["values"]  # combined up the hierarchy like every overlay
    assert "sensitivity_analysis_pass" in html.read_text()  # in the pass history


def test_report_reads_a_sensitivity_file_and_refuses_bad_ones(ckpt: tuple[Path, ForgeGraph], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = ckpt
    info = {"method": "loss", "baseline_loss": 0.7, "groups": [], "layers": [
        {"name": "bert.pooler.dense", "params": 1024, "quant": [[8, 0.01], [2, 0.4]]},
        {"name": "classifier", "params": 64, "quant": [[4, 0.2]]}]}
    good = tmp_path / "sens.json"
    good.write_text(json.dumps(info))
    html = tmp_path / "r.html"
    assert main(["report", str(path), "-o", str(html), "--sensitivity", str(good)]) == 0, capsys.readouterr().err
    items = _view(html)["items"]
    assert items["n:bert_pooler_dense"]["values"]["sensitivity"] == 0.4  # the narrowest width's increase
    assert items["n:classifier"]["values"]["sensitivity"] == 0.2
    capsys.readouterr()
    info["layers"][1]["name"] = "</script>nope"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(info))
    for args, fragment in ((["--sensitivity", str(bad)], "names layers this graph does not have"),
                           (["--sensitivity", str(tmp_path / "none.json")], "no such file"),
                           (["--sensitivity", str(good), "--sensitivity-data", "1"], "not both"),
                           (["--sensitivity-data", "1", "--sensitivity-method", "magic"], "fisher, hessian_trace")):
        assert main(["report", str(path), "-o", str(html), *args]) == 1
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_draw_depth_overlay_flat_and_the_missing_graphviz_error(ckpt: tuple[Path, ForgeGraph], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path, mg = ckpt
    dot = tmp_path / "g.dot"
    assert main(["draw", str(path), "-o", str(dot), "--depth", "1", "--overlay", "params"]) == 0
    text = dot.read_text(encoding="utf-8")
    assert 'id="g:bert"' in text and 'label="parameters (log scale)"' in text
    assert len(re.findall(r"^\s+n\d+ \[", text, re.M)) <= 30
    assert main(["draw", str(path), "-o", str(dot), "--depth", "all"]) == 0
    assert len(re.findall(r"^\s+n\d+ \[", dot.read_text(encoding="utf-8"), re.M)) == len(list(mg.nodes))
    flat = tmp_path / "flat.svg"
    assert main(["draw", str(path), "-o", str(flat), "--flat"]) == 0
    assert flat.read_text().count('<g class="node"') == len(list(mg.nodes))
    capsys.readouterr()
    monkeypatch.setenv("PATH", str(tmp_path))  # no Graphviz on it
    for args, fragment in ((["-o", str(tmp_path / "g.svg")], "apt-get install graphviz"),
                           (["-o", str(dot), "--depth", "deep"], "--depth must be"),
                           (["-o", str(dot), "--overlay", "sensitivity"], "--sensitivity-data"),
                           (["-o", str(dot), "--overlay", "heat"], "unknown overlay 'heat'"),
                           (["-o", str(flat), "--flat", "--depth", "1"], "--flat")):
        assert main(["draw", str(path), *args]) == 1
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_calibration_batches_vary_the_ids_and_keep_masks_and_labels() -> None:
    gen = torch.Generator().manual_seed(3)
    example = ExampleInputs(kwargs={"input_ids": torch.randint(5, 90, (2, 12), generator=gen),
                                    "attention_mask": torch.tensor([[1] * 12, [1] * 6 + [0] * 6]),
                                    "labels": torch.tensor([0, 1]), "x": torch.randn(2, 3, generator=gen)})
    first, *rest = calibration_batches(example, 3)
    assert first is example and len(rest) == 2
    pool = set(example.kwargs["input_ids"].flatten().tolist())
    for batch in rest:
        ids = batch.kwargs["input_ids"]
        assert ids.shape == (2, 12) and ids.dtype == torch.long and set(ids.flatten().tolist()) <= pool
        assert not torch.equal(ids, example.kwargs["input_ids"])
        assert torch.equal(batch.kwargs["attention_mask"], example.kwargs["attention_mask"])
        assert torch.equal(batch.kwargs["labels"], example.kwargs["labels"])
        assert 0 < float((batch.kwargs["x"] - example.kwargs["x"]).abs().max()) < 1
    assert not torch.equal(rest[0].kwargs["input_ids"], rest[1].kwargs["input_ids"])
