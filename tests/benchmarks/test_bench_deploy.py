"""bench_deploy_minilm end to end on a tiny BERT with MiniLM's vocabulary (the demo's checkpoints are not needed):
every artifact is built by fxforge.deploy or ORT's quantizers and run, the search point whose MXINT weights QDQ
refuses is replaced by its shrunk structure in int8, and what is printed and written is what was measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fxforge import ForgeGraph
from fxforge.benchmarks.minilm_ship import prune_ffn
from fxforge.models.bert import tiny_bert
from fxforge.passes.quantize import quantize_transform_pass

MXINT3 = {"by": "type", "default": {"config": {"name": None}},
          "linear": {"config": {"name": "mxint", "weight_width": 3, "weight_block_size": 32}}}
# linears quantizing their inputs too: a point whose float twin would compute something else
INT8_ACTING = {"by": "type", "default": {"config": {"name": None}},
               "linear": {"config": {"name": "scaled_integer", "weight_width": 8, "data_in_width": 8}}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fine-tuned-like fp32 checkpoint and a search-like point (half the FFN units, MXINT3 linear weights)."""
    root = tmp_path_factory.mktemp("bench-deploy")
    base = ForgeGraph(tiny_bert(num_attention_heads=4), hf_input_names=["input_ids", "attention_mask", "labels"])
    base.eval().export(root / "fp32")
    point, _ = quantize_transform_pass(prune_ffn(base, 0.5), MXINT3)
    point.eval().export(root / "best")
    return root / "fp32", root / "best"


@pytest.mark.slow_deploy  # every artifact built, an AOTInductor compile among them: make test-deploy
def test_bench_builds_runs_and_reports_every_artifact(checkpoints: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.benchmarks.bench_deploy_minilm import (
        AOTI,
        EAGER,
        FXFORGE_DYN,
        FXFORGE_INT8,
        ORT_OWN,
        SHRUNK,
        SHRUNK_DYN,
        main,
    )

    fp32, best = checkpoints
    keep, out = tmp_path / "artifacts", tmp_path / "r.json"
    code = main(["--model", str(fp32), "--best", str(best), "--quick", "--in-process", "--eval", "16", "--calib", "16",
                 "--length", "16", "--rounds", "1", "--keep", str(keep), "--json", str(out)])
    text, res = capsys.readouterr().out, json.loads(out.read_text())
    assert code == 0 and text.startswith("CPU: ") and "threads" in text.splitlines()[0]
    rows, targets = res["artifacts"], res["targets"]
    assert set(rows) == {EAGER, "ORT fp32", *ORT_OWN, FXFORGE_INT8, FXFORGE_DYN, SHRUNK, SHRUNK_DYN, AOTI,
                         "torch.ao dynamic int8"}
    # bytes are the files' own (here the fp32 word embeddings dominate: only ORT's dynamic int8 quantizes them)
    fp32_onnx = (keep / "fp32" / "model.onnx").stat().st_size
    assert res["fp32_onnx_bytes"] == rows["ORT fp32"]["bytes"] == fp32_onnx
    assert rows[AOTI]["bytes"] == (keep / "aoti" / "model.pt2").stat().st_size
    assert rows[FXFORGE_INT8]["bytes"] == (keep / "int8" / "model.onnx").stat().st_size
    for name in (*ORT_OWN, FXFORGE_INT8, FXFORGE_DYN, SHRUNK, SHRUNK_DYN):
        assert rows[name]["x_fp32_bytes"] == rows[name]["bytes"] / fp32_onnx
    assert rows[ORT_OWN[0]]["x_fp32_bytes"] < 0.5
    assert rows[EAGER]["bytes"] is None and rows["torch.ao dynamic int8"]["bytes"] is None
    # the MXINT point is refused as QDQ naming a layer; its structure is what the shrunk row exports
    assert re.search(r"best point as is, ONNX QDQ: refused: .*encoder\.layer\.\d\..*mxint", text)
    # the point's own graph (its pruned structure and trained weights, as float) is what the shrunk rows lower to int8
    assert "shrunk + int8 ONNX QDQ: the best point's own graph (50.0% of FFN units removed" in text
    # the compiled-fp32 ceiling is profiled per shape and carried on AOTInductor's target line
    for shape in ("8x", "1x"):
        c = res["ceiling"][shape]
        assert c["gemm_ms"] > 0 and 0 < c["floor_x"] <= 1 and f"ceiling at {shape}16: eager " in text
    assert any(f"compiled-fp32 ceiling: {res['ceiling']['8x']['floor_x']:.3f}x" in k for k in targets)
    assert rows[FXFORGE_INT8]["reference"] == "fxforge int8 graph" and rows[SHRUNK]["reference"] == "shrunk int8 graph"
    assert rows[FXFORGE_DYN]["reference"] == "fxforge int8 dynamic graph"
    assert rows[SHRUNK_DYN]["reference"] == "shrunk int8 dynamic graph"
    for name, r in rows.items():  # ratios and differences follow from the measured numbers
        assert set(r["median_ms"]) == {"8x", "1x"}
        for shape, ms in r["median_ms"].items():
            assert r["x_eager"][shape] == pytest.approx(ms / rows[EAGER]["median_ms"][shape])
        assert r["diff_pt"] == pytest.approx(100 * (r["accuracy"] - res["graph_accuracy"][r["reference"]]))
        assert re.search(rf"^{re.escape(name)} +{r['median_ms']['8x']:.1f} +{r['x_eager']['8x']:.3f} ", text, re.M)
    assert res["eval_reviews"] == 16 and all(0 <= r["accuracy"] <= 1 for r in rows.values())
    assert len(re.findall(r"^(met    |NOT met|missing) ", text, re.M)) == len(targets)
    assert all(v in (True, False) for v in targets.values())  # every artifact was built: nothing missing
    # fxforge's fastest int8 artifact (static QDQ or dynamic) against ORT's fastest own quantizer
    i8 = min(rows[n]["x_eager"]["8x"] for n in (FXFORGE_INT8, FXFORGE_DYN))
    own = min(rows[n]["x_eager"]["8x"] for n in ORT_OWN)
    # judged on the paired rounds (one round here: the one ratio is its own interval)
    mine = min((FXFORGE_INT8, FXFORGE_DYN), key=lambda n: rows[n]["median_ms"]["8x"])
    theirs = min(ORT_OWN, key=lambda n: rows[n]["median_ms"]["8x"])
    ratio = rows[mine]["samples_ms"]["8x"][0] / rows[theirs]["samples_ms"]["8x"][0]
    [key] = [k for k in targets if k.startswith(f"fxforge ONNX int8 {i8:.3f}x <= best ORT own quantizer {own:.3f}x")]
    assert f"{mine} / {theirs} paired over rounds {ratio:.3f}" in key and targets[key] == (ratio <= 1)


@pytest.mark.slow_deploy  # two int8 exports: make test-deploy
def test_without_a_search_point_ffn_sparsity_stands_in(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    import argparse

    from fxforge.benchmarks.bench_deploy_minilm import SHRUNK, SHRUNK_DYN, Log, Variant, ffn_widths, shrunk_point
    from fxforge.search import TextClassificationTask

    fp32, _ = checkpoints
    base = ForgeGraph.from_checkpoint(fp32).eval()
    task = TextClassificationTask("imdb", train_size=16, eval_size=16, max_length=16, eval_batch_size=8,
                                  progress=False, calibration_size=16)
    missing = str(tmp_path / "no-search-point")
    graphs: dict[str, ForgeGraph] = {}
    variants: dict[str, Variant] = {}
    log = Log()
    shrunk_point(argparse.Namespace(best=missing, ffn_sparsity=None, calib=16), base, task, graphs, variants, log,
                 tmp_path / "a")
    assert not variants and "skipped" in log[-1]  # no point and no fraction: no shrunk row, said so
    shrunk_point(argparse.Namespace(best=missing, ffn_sparsity=0.5, calib=16), base, task, graphs, variants, log,
                 tmp_path / "b")
    assert set(variants) == {SHRUNK, SHRUNK_DYN}
    for name, v in variants.items():
        assert ffn_widths(graphs[v.reference]) == [w // 2 for w in ffn_widths(base)], name
        batch = {k: t for k, t in task.eval_batches()[0][0].items() if k != "labels"}
        assert v.run(**batch).shape == (batch["input_ids"].shape[0], 2)
    assert any("--ffn-sparsity (50.0% of FFN units removed" in note for note in log)
    # a search point quantizing its activations cannot lend its weights as float: its structure is re-pruned
    acting, _ = quantize_transform_pass(prune_ffn(base, 0.5), INT8_ACTING)
    acting.eval().export(tmp_path / "acting")
    variants.clear()
    shrunk_point(argparse.Namespace(best=str(tmp_path / "acting"), ffn_sparsity=None, calib=16), base, task, graphs,
                 variants, log, tmp_path / "c")
    assert set(variants) == {SHRUNK, SHRUNK_DYN}
    assert any("own weights cannot stand in" in note and "quantizes ['data_in']" in note for note in log)
    assert ffn_widths(graphs[variants[SHRUNK].reference]) == [w // 2 for w in ffn_widths(base)]


def test_weights_as_float_keeps_a_search_points_outputs() -> None:
    """A pruned point with MXINT3 Linear and MXINT4 embedding weights becomes plain float layers holding what its
    quantizers compute: outputs equal at two shapes; a layer quantizing its inputs is refused by name."""
    import torch

    from fxforge.benchmarks.deploy_runtimes import weights_as_float
    from fxforge.passes.quantize.modules import QuantizedEmbedding, QuantizedLinear

    base = ForgeGraph(tiny_bert(num_attention_heads=4), hf_input_names=["input_ids", "attention_mask", "labels"])
    config = {**MXINT3, "embedding": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 32}}}
    point, _ = quantize_transform_pass(prune_ffn(base.eval(), 0.5), config)
    point = point.eval()
    plain = weights_as_float(point)
    kinds = {type(m) for m in plain.model.modules()}
    assert QuantizedLinear not in kinds and QuantizedEmbedding not in kinds
    assert any(isinstance(m, QuantizedLinear) for m in point.model.modules())  # the point itself is untouched
    q = point.model.get_submodule("bert.encoder.layer.0.intermediate.dense")
    w = plain.model.get_submodule("bert.encoder.layer.0.intermediate.dense").weight
    assert not torch.equal(w, q.weight) and torch.equal(w, q.weight_quantizer(q.weight))
    for batch, seq in ((2, 9), (3, 16)):
        inputs = {"input_ids": torch.randint(0, 100, (batch, seq)),
                  "attention_mask": torch.ones(batch, seq, dtype=torch.long), "labels": torch.zeros(batch).long()}
        with torch.no_grad():
            assert torch.equal(plain.model(**inputs)["logits"], point.model(**inputs)["logits"])
    acting, _ = quantize_transform_pass(base.copy(), INT8_ACTING)
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.0\.attention\.self\.query: quantizes \['data_in'\]"):
        weights_as_float(acting)
