"""bench_llm_quant: every (format, bits, method) is a measured row or a "not available: <why>" row, and the table
shows exactly what was measured.

Unmarked: ``measure`` + ``table`` on the zoo GPT fixture (random tokens, loss as the metric) with RTN, GPTQ and a
method whose pass is missing. Slow: ``--quick`` end to end (trains a tiny GPT on the review text, fine-tunes a tiny
BERT), its JSON and markdown read back and one row recomputed from the passes directly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.benchmarks import bench_llm_quant as bench
from fxforge.benchmarks.llm_quant_models import GPT_TARGETS, Subject, gpt_subject
from fxforge.models.gpt import lm_loss
from fxforge.passes import get_pass


def _cell(row: dict) -> str:
    return f"{row['value']:.4f} ({row['delta']:+.4f})"


def _gpt_subject() -> Subject:
    gen = torch.Generator().manual_seed(0)
    calib = [(torch.randint(0, 64, (4, 32), generator=gen),) for _ in range(2)]
    held = torch.randint(0, 64, (8, 33), generator=gen)
    graph = ForgeGraph(make_gpt(), calib[0]).eval()

    def loss(g: ForgeGraph) -> float:
        with torch.no_grad():
            return lm_loss(g(held[:, :-1]), held[:, 1:]).item()

    return Subject("gpt", "loss", False, graph, calib, loss, GPT_TARGETS, {"mode": "layernorm"})


def test_rows_are_measured_or_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    subject = _gpt_subject()
    monkeypatch.setitem(bench.PASSES, "AWQ", "no_such_awq_transform_pass")  # a pass that is not there
    methods = ["RTN", "GPTQ", "AWQ"]
    res = bench.measure(subject, ["scaled_integer"], [3], methods)
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == methods and res["layers"] == 8  # 2 blocks x (qkv, proj, fc, proj)
    assert res["fp32"] == subject.evaluate(subject.graph)
    # RTN's row is the round-to-nearest graph's metric
    rtn_graph, _ = get_pass("quantize_transform_pass")(subject.graph, bench.weight_config("scaled_integer", 3,
                                                                                         GPT_TARGETS))
    assert rows["RTN"]["value"] == subject.evaluate(rtn_graph) != res["fp32"]
    assert "error" not in rows["GPTQ"] and rows["GPTQ"]["value"] != rows["RTN"]["value"]
    assert "no pass named 'no_such_awq_transform_pass'" in rows["AWQ"]["error"] and "value" not in rows["AWQ"]
    md = bench.table(res, ["scaled_integer"], [3], methods).splitlines()
    assert md[0].startswith("| gpt: loss (lower is better) | scaled_integer 3-bit |")
    assert md[2] == f"| fp32 | {res['fp32']:.4f} |"
    assert md[3] == f"| RTN | {_cell(rows['RTN'])} |" and md[4] == f"| GPTQ | {_cell(rows['GPTQ'])} |"
    assert md[5].startswith("| AWQ | not available: KeyError: \"no pass named 'no_such_awq_transform_pass'")


def test_a_paired_metric_is_measured_beside_and_counted_in_the_verdict() -> None:
    subject = _gpt_subject()
    held = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(5))

    def top1(g: ForgeGraph) -> float:
        with torch.no_grad():
            return (g(held[:, :-1]).argmax(-1) == held[:, 1:]).float().mean().item()

    subject.paired = ("top-1", True, top1)
    res = bench.measure(subject, ["scaled_integer"], [3, 4], ["RTN", "GPTQ"])
    assert res["paired"] == {"metric": "top-1", "higher_is_better": True, "fp32": top1(subject.graph)}
    rtn_graph, _ = get_pass("quantize_transform_pass")(subject.graph, bench.weight_config("scaled_integer", 3,
                                                                                         GPT_TARGETS))
    rtn3 = next(r for r in res["rows"] if (r["method"], r["bits"]) == ("RTN", 3))
    assert rtn3["paired"] == top1(rtn_graph) and rtn3["paired_delta"] == rtn3["paired"] - res["paired"]["fp32"]
    view = bench.paired_view(res)
    assert view is not None and view["fp32"] == res["paired"]["fp32"]
    md = bench.table(view, ["scaled_integer"], [3, 4], ["RTN", "GPTQ"]).splitlines()
    assert md[0].startswith("| gpt: top-1 (higher is better) |") and f"{rtn3['paired']:.4f}" in md[3]
    rows = {(r["method"], r["bits"]): r for r in res["rows"]}
    by_loss = sum(rows[("GPTQ", b)]["value"] < rows[("RTN", b)]["value"] for b in (3, 4))
    by_top1 = sum(rows[("GPTQ", b)]["paired"] > rows[("RTN", b)]["paired"] for b in (3, 4))
    assert bench.verdict(res, ["RTN", "GPTQ"]) == [
        f"gpt: GPTQ loses less than RTN in {by_loss}/2 by loss, {by_top1}/2 by top-1"]
    assert bench.paired_view(bench.measure(_gpt_subject(), ["scaled_integer"], [3], ["RTN"])) is None


def test_a_pass_that_quantizes_other_layers_is_not_reported() -> None:
    """A method whose graph does not have exactly the block linears quantized is refused, not measured."""
    subject = _gpt_subject()
    cfg = bench.weight_config("scaled_integer", 4, r"blocks\.0\..*c_fc")  # one layer instead of eight
    with pytest.raises(bench.NotAvailable, match="quantized 1 layers, not the 8 block linears"):
        bench.quantize(subject, "RTN", cfg, None)


@pytest.mark.slow
def test_quick_run_writes_the_tables_it_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench.main(["--quick", "--run-dir", str(tmp_path)])
    text = capsys.readouterr().out
    saved = json.loads((tmp_path / "bench_llm_quant.json").read_text())
    md = (tmp_path / "bench_llm_quant.md").read_text()
    assert saved["models"][0]["rows"] == json.loads(json.dumps(out["models"][0]["rows"], default=str))
    assert text.startswith("CPU: ") and "weights-only quantization" in md and "activations stay fp32" in md
    assert "--quick" in md and '"calib_seqs": 16' in md
    assert [m["name"] for m in saved["models"]] == ["zoo GPT", "tiny BERT (quick)"]
    for model in saved["models"]:
        rows = model["rows"]
        assert len(rows) == 2 * 2 * 4  # scaled_integer and mxint, 4 and 3 bits, every method
        assert all(("value" in r) != ("error" in r) for r in rows)
        assert all("value" in r for r in rows if r["method"] in ("RTN", "GPTQ") and r["format"] != "mxint")
        for r in rows:
            if "value" in r:
                assert re.search(rf"^\| {re.escape(r['method'])} \|(.* \|)? {re.escape(_cell(r))} \|", md, re.M)
            else:
                assert r["error"][:40] in md
    gpt = saved["models"][0]
    rtn3 = next(r for r in gpt["rows"] if (r["method"], r["format"], r["bits"]) == ("RTN", "scaled_integer", 3))
    subject = gpt_subject(tmp_path, True, 16, 16)  # the cached GPT: same weights, same held-out windows
    graph, _ = get_pass("quantize_transform_pass")(subject.graph, bench.weight_config("scaled_integer", 3,
                                                                                      GPT_TARGETS))
    assert subject.evaluate(subject.graph) == pytest.approx(gpt["fp32"], rel=1e-6)
    assert subject.evaluate(graph) == pytest.approx(rtn3["value"], rel=1e-6) and rtn3["value"] != gpt["fp32"]


def test_held_out_accuracy_and_loss_come_from_one_pass() -> None:
    from conftest import bert_inputs, make_tiny_bert

    from fxforge.benchmarks.llm_quant_models import HeldOut
    from fxforge.search import TensorTask

    inputs = bert_inputs(labels=False, batch=10, seq=9)
    labels = torch.tensor([0, 1] * 5)
    task = TensorTask(inputs, labels, batch_size=4)
    graph = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    held = HeldOut(task)
    passes = []
    original = task.eval_batches
    task.eval_batches = lambda: passes.append(1) or original()  # type: ignore[method-assign]
    acc = held.accuracy(graph)
    loss = held.loss(graph)
    assert len(passes) == 1  # the loss of the graph just measured is the one that pass kept
    assert acc == task.accuracy(graph)
    with torch.no_grad():
        logits = graph(**inputs).logits
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-6)
    other = graph.copy()
    held.loss(other)  # another graph: measured, not the kept value
    assert len(passes) == 3
