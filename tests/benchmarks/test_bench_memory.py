"""bench_memory --quick end to end on tiny models: what it prints and writes is what it measured (peaks from the
allocator, step times, liveness estimates), fxforge's checkpointing really lowers the measured peak, and its
met/MISSED lines and exit code follow from those numbers. No timing is asserted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


def test_quick_bench_prints_measured_peaks_and_its_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.benchmarks.bench_memory import (
        AT_COMPILE,
        AT_PER_LAYER,
        AT_PER_LAYER_ATTENTION,
        LORA_MARGIN,
        MARGIN,
        MEASURED_MARGIN,
        TARGETS,
        main,
    )

    code = main(["--quick", "--json", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    assert text.startswith("CPU: ") and "threads" in text.splitlines()[0] and res["quick"]
    assert "fxforge pass: not available yet" not in text
    sections = [k for k in res if k not in ("cpu", "threads", "quick", "checks", "lora")]
    assert len(sections) == 2 and all(("BERT" in k) != ("GPT" in k) for k in sections)
    for label in sections:
        peaks, ms = res[label]["peak_bytes"], res[label]["median_ms"]
        ours = next(k for k in peaks if k.startswith("fxforge checkpoint"))
        # planned for a share of the unmodified graph's MEASURED peak, in the pass's units (bytes, MB = 2^20)
        named = re.fullmatch(r"fxforge checkpoint ([0-9.]+)x unmodified", ours)
        assert named is not None and float(named.group(1)) >= TARGETS["memory"] * (1 - MARGIN)
        plan = res[label]["plan"]
        assert abs(plan["budget_bytes"] - float(named.group(1)) * peaks["unmodified graph"]) <= 1
        assert plan["planned_peak_bytes"] <= plan["budget_bytes"] < plan["baseline_peak_bytes"]
        # the equal-memory rows: fitted on measured peaks for (1 - MEASURED_MARGIN) x every-layer checkpoint's
        # MEASURED peak, or, where no plan measures within it, reported with the smallest peak the pass gives
        per_layer = "torch.utils.checkpoint every layer"
        timed = set()
        for row in (AT_PER_LAYER, AT_PER_LAYER_ATTENTION):
            record = res[label]["equal_memory"][row]
            assert record["reference"] == per_layer and record["reference_peak_bytes"] == peaks[per_layer]
            assert abs(record["budget_bytes"] - (1 - MEASURED_MARGIN) * peaks[per_layer]) <= 1
            assert record["how"] == "measured"
            if record.get("unreachable"):
                assert row not in peaks and record["smallest_reachable_bytes"] > record["budget_bytes"]
                assert f"{row} ({label}): no plan within" in text
            else:
                assert record["measured_peak_bytes"] <= record["budget_bytes"] and row in peaks
                assert record["measured_plans"] >= 1
                assert f"{label}: {row}: peak <= {per_layer}'s" in res["checks"]
                timed.add(row)
        rows = {"unmodified graph", ours, per_layer} | timed
        assert set(peaks) == set(ms) == rows
        assert AT_COMPILE not in res[label]["equal_memory"]  # --quick compiles nothing
        fastest = [c for c in res["checks"] if c.startswith(f"{label}: fxforge's fastest plan within {per_layer}'s")]
        assert len(fastest) == 1 and fastest[0].endswith(f"step time <= {per_layer}'s")
        best = min(timed, key=lambda r: ms[r]) if timed else None
        assert f"({best})" in fastest[0]
        assert res["checks"][fastest[0]] == (best is not None and ms[best] <= ms[per_layer]
                                             and peaks[best] <= peaks[per_layer])
        assert 0 < peaks[ours] < peaks["unmodified graph"]  # recomputation really frees memory
        assert peaks["torch.utils.checkpoint every layer"] < peaks["unmodified graph"]
        ratio = peaks[ours] / peaks["unmodified graph"]
        assert re.search(rf"^  {re.escape(ours)} +{peaks[ours] / 2**20:.2f} +{ratio:.3f} ", text, re.M)
        live = res[label]["liveness"]
        assert set(live) == {"unmodified graph", "after the pass"}
        for row in live.values():
            assert all(v["estimate"] > 0 and v["measured"] > 0 for v in row.values())
    lora = res["lora"]
    assert {"PEFT LoRA", "fxforge LoRA"} <= set(lora["peak_bytes"]) | set(lora["failed"])
    for name, why in lora["failed"].items():  # a broken variant is reported, not hidden
        assert f"{name}" in text and "FAILED" in text and why[:40] in text
    # the LoRA + checkpoint row is planned for a share of PEFT's measured peak, not of its own
    both = next(k for k in lora["peak_bytes"] if k.startswith("fxforge LoRA + checkpoint"))
    named = re.fullmatch(r"fxforge LoRA \+ checkpoint ([0-9.]+)x PEFT", both)
    assert named is not None
    share = float(named.group(1))
    assert share >= TARGETS["lora_memory"] * (1 - LORA_MARGIN)
    assert abs(lora["plan"]["budget_bytes"] - share * lora["peak_bytes"]["PEFT LoRA"]) <= 1
    assert lora["plan"]["planned_peak_bytes"] <= lora["plan"]["budget_bytes"]
    checks = res["checks"]
    assert len(re.findall(r"^(met   |MISSED) ", text, re.M)) == len(checks) >= 12
    assert code == (0 if all(checks.values()) else 1)


@pytest.mark.parametrize("only", ["classifier", "gpt", "lora"])
def test_only_runs_that_section(only: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--only runs one section (the LoRA rows alone re-run in a minute); no model is timed here."""
    from fxforge.benchmarks import bench_memory

    ran: list[str] = []
    monkeypatch.setattr(bench_memory, "bench_model", lambda model, inputs, label, *rest: ran.append(
        "gpt" if "GPT" in label else "classifier"))
    monkeypatch.setattr(bench_memory, "bench_lora", lambda *a: ran.append("lora"))
    assert bench_memory.main(["--quick", "--only", only]) == 1  # no check ran: not a pass
    assert ran == [only]


def test_equal_memory_plan_below_reach_reports_the_smallest_reachable_peak() -> None:
    """A peak no plan reaches (1 KB on the tiny GPT) gives no graph, and the record holds the smallest peak the
    pass reports reachable (parsed from its error), above the budget; a reachable one is planned within it."""
    from fxforge.benchmarks.bench_memory import MARGIN, capture
    from fxforge.benchmarks.memory_variants import gpt, plan_equal_memory

    model, inputs, _ = gpt(True)
    graph = capture(model, inputs)
    ours, record = plan_equal_memory(graph, inputs, "reference", 1024, MARGIN)
    assert ours is None and record["unreachable"] and record["budget_bytes"] == int((1 - MARGIN) * 1024)
    assert record["smallest_reachable_bytes"] is not None and record["smallest_reachable_bytes"] > 1024
    reachable = int(record["smallest_reachable_bytes"] / (1 - MARGIN)) + 4096
    ours, record = plan_equal_memory(graph, inputs, "reference", reachable, MARGIN)
    assert ours is not None and not record.get("unreachable")
    assert record["planned_peak_bytes"] <= record["budget_bytes"] <= (1 - MARGIN) * reachable
    # "smallest": the plan for the smallest peak the pass reaches, when that is within the budget
    ours, smallest = plan_equal_memory(graph, inputs, "reference", reachable, MARGIN, how="smallest")
    assert ours is not None and smallest["planned_peak_bytes"] <= record["planned_peak_bytes"]
    ours, _ = plan_equal_memory(graph, inputs, "reference", 1024, MARGIN, how="smallest")
    assert ours is None
    # "measured": the pass fits the budget on measured peaks, and says what it measured
    ours, measured = plan_equal_memory(graph, inputs, "reference", 10 * reachable, MARGIN, how="measured")
    assert ours is not None and measured["measured_peak_bytes"] <= measured["budget_bytes"]
    assert measured["measured_plans"] >= 1
