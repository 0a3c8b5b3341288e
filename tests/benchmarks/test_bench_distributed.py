"""bench_distributed: what it prints follows from what its ranks measured (no timing asserted).

Unmarked: one rank in this process (a 1-process gloo group) runs the baseline of a tiny GPT and reports real
parameter bytes and memory peaks. Slow: ``--quick`` end to end (three launches, N = 1, 2, 4), every printed row and
met / NOT met fact re-derived here from the raw measures in its JSON."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.benchmarks.bench_distributed import PARAMS_TARGET, THROUGHPUT_TARGET, both_met, checks, main, summarize
from fxforge.benchmarks.distributed_ranks import BenchModel, RankSpec, rank_entry
from fxforge.distributed.ddp import free_port


def test_one_rank_measures_the_unsplit_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    mg = ForgeGraph(make_gpt(), idx[:2]).eval()
    model = BenchModel("gpt", str(mg.export(tmp_path / "gpt")), {"idx": idx})
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        m = rank_entry(RankSpec(models=(model,), schedules=("gpipe",), microbatches=2, repeats=2, warmup=1,
                                threads=1, timeout=60.0))
    finally:
        torch.set_num_threads(threads)
    params = sum(p.numel() * p.element_size() for p in mg.model.parameters())
    assert m.world == 1 and m.threads == 1 and m.total["gpt"] == params
    assert m.held["gpt"] == params  # the loaded graph's parameters, counted over the live nn.Parameters
    assert list(m.times) == ["gpt/forward", "gpt/microbatched"]  # the whole batch, and 2 microbatches in turn
    assert all(len(t) == 2 and min(t) > 0 for t in m.times.values()) and m.load_peak["gpt"] > params
    rows = summarize({1: [[m.__dict__]]}, ["gpt"], ["gpipe"], {"gpt": 4})
    assert [r["schedule"] for r in rows] == ["forward", "microbatched"]
    assert rows[0]["rel_throughput"] == 1.0 and rows[0]["held_ratio"] == 1.0
    assert rows[1]["rel_throughput"] == pytest.approx(rows[0]["ms"] / rows[1]["ms"])
    assert checks(rows) == {}  # targets are stated at N = 2 only


@pytest.mark.slow
def test_quick_bench_rows_follow_from_the_measures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--quick", "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    lines = text.splitlines()
    assert lines[0].startswith("CPU: ") and "load average" in lines[0] and "N=4" in text and "oversubscribed" in text
    runs = res["runs"]
    assert sorted(runs) == ["1", "2", "4"] and all(len(runs[n][0]) == int(n) for n in runs)
    facts, both = {}, []
    for model in res["batch"]:
        base_ms = 1e3 * statistics.median(runs["1"][0][0]["times"][f"{model}/forward"])
        base_held = runs["1"][0][0]["held"][model]
        for n in ("2", "4"):
            ranks = runs[n][0]
            for schedule in ("gpipe", "1f1b", "tp"):
                held = [r["held"][model + ("/tp" if schedule == "tp" else "")] for r in ranks]
                assert max(held) < base_held  # each rank really holds only its stage / its shards
                ms = 1e3 * statistics.median(ranks[0]["times"][f"{model}/{schedule}"])
                rel, ratio = base_ms / ms, max(held) / base_held
                row = rf"^  {re.escape(model)} +{schedule} +{n} +\d+ +{ms:.2f} +[\d.]+ +{rel:.2f}x +{ratio:.3f}x "
                assert re.search(row, text, re.M), row
                if schedule != "tp":  # against one process running the same microbatches one after the other
                    alone = 1e3 * statistics.median(runs["1"][0][0]["times"][f"{model}/microbatched"])
                    assert f"  {model} {schedule} N={n}: {alone / ms:.2f}x the throughput of one process" in text
                if n == "2":
                    split = "tensor parallel" if schedule == "tp" else "pipeline"
                    facts[f"{model} {schedule} N=2: throughput {rel:.2f}x of N=1"] = rel >= THROUGHPUT_TARGET
                    facts[f"{model} {split} N=2: largest rank's parameters {ratio:.3f}x of N=1"] = \
                        ratio <= PARAMS_TARGET
                    if rel >= THROUGHPUT_TARGET and ratio <= PARAMS_TARGET:
                        both.append(f"{model} {schedule}")
    printed = re.findall(r"^(met    |NOT met) (.*) \(target", text, re.M)
    assert len(printed) == len(res["checks"]) == 10  # per model: 3 throughputs, the pipeline's and tp's parameters
    for verdict, what in printed:
        assert facts[what] == (verdict == "met    "), what
    assert f"both targets at N=2: {', '.join(both) or 'none'}" in lines
    assert code == (0 if all(facts.values()) else 1)


def test_both_targets_name_the_configurations_meeting_them_together() -> None:
    def row(schedule: str, n: int, rel: float, ratio: float) -> dict[str, object]:
        return {"model": "m", "schedule": schedule, "n": n, "rel_throughput": rel, "held_ratio": ratio}
    rows = [row("gpipe", 2, 0.9, 0.6), row("1f1b", 2, 0.8, 0.5), row("tp", 2, 0.86, 0.51), row("tp", 4, 0.9, 0.3)]
    assert both_met(rows) == ["m tp"]


@pytest.mark.parametrize("size", ["t1024", "toy"])
def test_the_gpt_is_the_one_asked_for(size: str, tmp_path: Path) -> None:
    """The full-size GPT is models/gpt.py's default (4 layers x 128) at T = 1024, 16 rows; ``--gpt toy`` the zoo's
    2-layer GPT at 32 x 64; ``--batch`` sets both models' rows; each is exported and loads with its parameters."""
    from fxforge.benchmarks.bench_distributed import _models

    bert, gpt = _models(False, tmp_path, None, size)
    layers, width, shape = (4, 128, (16, 1024)) if size == "t1024" else (2, 64, (32, 64))
    assert tuple(gpt.inputs["idx"].shape) == shape and tuple(bert.inputs["input_ids"].shape) == (32, 128)
    loaded = ForgeGraph.from_checkpoint(gpt.checkpoint)
    names = {n for n, _ in loaded.model.named_parameters()}
    assert sum(n.endswith("c_fc.weight") for n in names) == layers
    assert loaded.model.get_parameter(next(n for n in names if n.endswith("wte.weight"))).shape[1] == width
    if size == "toy":
        _, small = _models(False, tmp_path / "rows", 3, size)
        assert small.inputs["idx"].shape[0] == 3
