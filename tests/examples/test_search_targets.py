"""The time-to-target pieces of the joint search example: the target score measures size from the exported
checkpoint's packed bytes and speed interleaved with fp32, meets a target only on the full held-out set, and
time_to_target.json holds every trial's finish time and the first one that met all three targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TinyMLP

from fxforge import ForgeGraph
from fxforge.examples.search_targets import (
    SCORE,
    Reference,
    Targets,
    packed_weight_bytes,
    score_of,
    target_objective,
    time_to_target,
    write_report,
)
from fxforge.graph.verify import measure_weights
from fxforge.search import MixedPrecisionSpace, Search, TensorTask


def _setup() -> tuple[ForgeGraph, TensorTask]:
    torch.manual_seed(0)
    net = TinyMLP().eval()
    x = torch.randn(64, 8)
    return ForgeGraph(net, (x[:4],)), TensorTask({"x": x}, net(x).argmax(-1), batch_size=32)


def test_score_is_negative_by_the_shortfalls_until_every_target_is_met() -> None:
    assert score_of({"accuracy": -2.0, "size": -1.0, "speed": 3.0}) == -3.0  # both misses count
    assert score_of({"accuracy": 0.5, "size": -0.25, "speed": 3.0}) == -0.25
    assert score_of({"accuracy": 0.5, "size": 0.0, "speed": 3.0}) == 0.0  # met exactly
    assert score_of({"accuracy": 0.5, "size": 1.0, "speed": 3.0}) == pytest.approx(0.05)


def test_score_and_report_of_a_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, task = _setup()
    reference = Reference.measure(base, task)
    assert reference.eval_samples == 64
    assert reference.weight_bytes == measure_weights(base.export(tmp_path / "b")).weights
    targets = Targets(max_drop=0.5, min_size_x=4.0, min_speed_x=0.01)  # 4-bit weights: 4.8x smaller, 8-bit: 3.1x
    objective = target_objective(base, reference, targets, timing_samples=4, repeats=2)
    space = MixedPrecisionSpace({"integer": {"width": [4, 8], "frac_width": [3]}}, roles=("weight",))
    start = 1e9  # any Unix time before the study: finish times are measured from it
    search = Search(space, [objective], base=base, task=task, n_trials=2, run_dir=tmp_path / "run", progress=False,
                    enqueue=[{"linear:integer:weight_width": 8}, {"linear:integer:weight_width": 4}])
    result = search.run()
    report = time_to_target(result.study, start, timeout=1e12, targets=targets, seed=0)
    rows = {r["trial"]: r for r in report["trials"]}
    for n, packed in ((0, False), (1, True)):
        graph = result.rebuild(result.study.trials[n])
        stored = measure_weights(graph.export(tmp_path / f"t{n}")).weights
        assert packed_weight_bytes(graph) == (stored, "packed")
        assert rows[n]["size_x"] == pytest.approx(reference.weight_bytes / stored)
        assert rows[n]["met"]["size"] is packed and rows[n]["met"]["speed"] and rows[n]["met"]["accuracy"]
        margins = result.study.trials[n].user_attrs["fxforge_result"]["notes"][SCORE]["margins"]
        assert rows[n]["score"] == pytest.approx(score_of(margins)) and (rows[n]["score"] >= 0) is packed
    assert report["first_trial_meeting_targets"] == 1 and report["time_to_target_s"] == rows[1]["finished_s"] > 0
    assert time_to_target(result.study, start, timeout=1.0, targets=targets)["time_to_target_s"] is None
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "time_to_target.json").read_text())["first_trial_meeting_targets"] == 1
    assert "time to target:" in capsys.readouterr().out
    fewer = objective.measure(base, TensorTask({"x": torch.randn(8, 8)}, torch.zeros(8, dtype=torch.long)))
    assert not any(fewer.notes["met"].values())  # an earlier rung's sample count: nothing is met there


@pytest.mark.slow_search  # MiniLM fine-tuned on 32 reviews, its sensitivity measured, two workers (5 min when loaded)
def test_joint_example_time_to_target_with_two_workers(tmp_path: Path) -> None:
    """--time-to-target end to end with tiny settings: two workers share the journal, trials finish (some pruned at
    the first rung or not), each finished trial's size is the packed checkpoint's, and the report is written."""
    from fxforge.examples.search_joint import main

    run = tmp_path / "run"
    assert main(["--time-to-target", "--recipe", "qat", "--workers", "2", "--threads", "1", "--seed", "1",
                 "--prior", "sensitivity", "--pruner", "hyperband", "--timeout", "900", "--trials", "4",
                 "--train-size", "32", "--eval-size", "40", "--max-length", "32", "--fidelity-steps", "1", "2", "4",
                 "--fidelity-samples", "8", "16", "40", "--calibration-size", "8", "--run-dir", str(run)]) == 0
    report = json.loads((run / "time_to_target.json").read_text())
    assert report["workers"] == 2 and report["seed"] == 1 and report["trials_finished"] >= 4  # --trials 4
    finished = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    assert finished and all(t["size_measured"] == "packed" and set(t["met"]) == {"accuracy", "size", "speed"}
                            for t in finished)
    assert all((run / "workers" / f"worker-{i}.log").is_file() for i in range(2))
    # a finished run's trial rebuilt (its fine-tune replayed) and exported, no trial run; an unknown one refused
    args = ["--time-to-target", "--recipe", "qat", "--seed", "1", "--prior", "sensitivity", "--pruner",
            "hyperband", "--train-size", "32", "--eval-size", "40", "--max-length", "32", "--fidelity-steps", "1",
            "2", "4", "--fidelity-samples", "8", "16", "40", "--calibration-size", "8", "--run-dir", str(run),
            "--resume"]
    number = finished[0]["trial"]
    assert main([*args, "--export-trials", str(number)]) == 0
    exported = ForgeGraph.from_checkpoint(run / "pareto" / f"trial_{number}")
    assert exported.model is not None and len(report["trials"]) == len(json.loads(
        (run / "time_to_target.json").read_text())["trials"])  # nothing ran
    with pytest.raises(SystemExit):
        main([*args, "--export-trials", "999"])


def test_joint_example_export_trials_needs_a_finished_run(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """--time-to-target --export-trials is refused before anything is built without --resume, or without the
    finished run's time_to_target.json in --run-dir."""
    from fxforge.examples.search_joint import main

    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit):
            main(["--time-to-target", "--export-trials", "0", "--run-dir", str(tmp_path), *extra])
        assert "rebuilds trials of a finished run" in capsys.readouterr().err


def test_workers_run_in_parallel_and_stop_when_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_workers starts N processes of a module with --worker I, keeps each one's log and exit code, and
    terminates those still running once done() is true (--stop-at-target) or the deadline passes."""
    import time

    from fxforge.examples.search_workers import run_workers

    (tmp_path / "fx_sleeper.py").write_text("import sys, time\nprint('worker', sys.argv[-1], flush=True)\n"
                                            "time.sleep(0 if sys.argv[-1] == '0' else 120)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    start = time.time()
    codes = run_workers("fx_sleeper", [], 2, start + 120, tmp_path / "logs", threads=1,
                        done=lambda: (tmp_path / "logs" / "worker-1.log").read_text() != "", poll_s=0.2)
    assert codes == [0, None] and time.time() - start < 60  # worker 1 stopped when done, long before its 120 s
    assert (tmp_path / "logs" / "worker-0.log").read_text() == "worker 0\n"
    assert run_workers("fx_sleeper", [], 1, time.time() + 3, tmp_path / "logs2") == [0]  # worker 0 exits by itself
