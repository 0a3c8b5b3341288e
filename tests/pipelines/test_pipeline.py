"""Pipeline: building, validation before any step runs, copy vs inplace, contract checks, report."""

from __future__ import annotations

import json
import time

import pytest
import torch
from toys import CALLS, small_graph, toy_passes  # noqa: F401 (fixture)

from fxforge.pipelines import ContractViolation, Pipeline, PipelineError
from fxforge.pipelines.pipeline import PIPELINE_RECORD

pytestmark = pytest.mark.usefixtures("toy_passes")


def _out(mg):
    return mg(*mg.example_inputs.args)


def test_unknown_pass_name_suggests_close_names() -> None:
    with pytest.raises(PipelineError, match=r"step 2: unknown pass 'remove_dropout_transfrom_pass'; did you mean "
                                            r"'remove_dropout_transform_pass'"):
        Pipeline(["_mark_pass", "remove_dropout_transfrom_pass"])
    with pytest.raises(PipelineError, match="not a registered pass"):
        Pipeline([lambda g, a: (g, None)])


def test_bad_key_in_step_3_refused_before_step_1_runs() -> None:
    calls = CALLS
    steps = ["_bounded_scale_pass", "_exact_scale_pass", ("_bounded_scale_pass", {"factr": 2.0})]
    with pytest.raises(PipelineError, match=r"step 3 \(_bounded_scale_pass\): invalid args:.*unknown pass_args "
                                            r"key\(s\) \['factr'\]; allowed keys: \['factor'\]"):
        Pipeline(steps)
    with pytest.raises(PipelineError, match=r"step 3 .*'factor'\] = 'two' does not match"):
        Pipeline.from_dict({"steps": [{"pass": "_bounded_scale_pass"},
                                      {"pass": "_exact_scale_pass"},
                                      {"pass": "_bounded_scale_pass", "args": {"factor": "two"}}]})
    with pytest.raises(PipelineError, match=r"step 3 \(_exact_scale_pass\): invalid contract thresholds.*tolerance"):
        Pipeline(["_bounded_scale_pass", "_exact_scale_pass", ("_exact_scale_pass", {}, {"tolerance": 1.0})])
    assert calls == []  # step 1 never ran
    Pipeline(steps[:2])(small_graph())
    assert calls == [("_bounded_scale_pass", 1), ("_exact_scale_pass", 2)]  # the valid steps do run


def test_impossible_order_refused_before_any_step() -> None:
    calls = CALLS
    pipe = Pipeline(["_bounded_scale_pass", "_needs_mark_pass", "_mark_pass"])
    mg = small_graph()
    with pytest.raises(PipelineError, match=r"impossible order: step 2 \(_needs_mark_pass\) requires '_marked'.*"
                                            r"run _mark_pass first"):
        pipe(mg)
    assert calls == [] and mg.history == []
    out, report = Pipeline(["_mark_pass", "_needs_mark_pass"])(mg)
    assert calls == [("_mark_pass", 1), ("_needs_mark_pass", 2)]
    assert [s.name for s in report.steps] == ["_mark_pass", "_needs_mark_pass"]


def test_input_graph_not_mutated_and_inplace() -> None:
    mg = small_graph()
    ref = _out(mg)
    weight = mg.model.get_submodule("0").weight.detach().clone()
    pipe = Pipeline([("_bounded_scale_pass", {"factor": 2.0})])
    out, _ = pipe(mg)
    assert torch.equal(mg.model.get_submodule("0").weight, weight) and mg.history == []
    assert torch.equal(_out(mg), ref) and not torch.equal(_out(out), ref)
    out2, _ = pipe(mg)  # the same pipeline on the same input gives the same result
    assert torch.equal(_out(out2), _out(out))
    assert [r.to_json() for r in out2.history] == [r.to_json() for r in out.history]
    same, _ = pipe(mg, inplace=True)
    assert same is mg and torch.equal(mg.model.get_submodule("0").weight, 2 * weight)


def test_broken_contract_stops_the_pipeline_naming_step_and_pass() -> None:
    pipe = Pipeline(["_exact_scale_pass", ("_exact_scale_pass", {"factor": 1.5}), "_bounded_scale_pass"],
                    name="faulty")
    with pytest.raises(ContractViolation, match=r"pipeline 'faulty': contract broken, checked after step 2 "
                                                r"\(_exact_scale_pass\): step 2 \(_exact_scale_pass\) exact contract: "
                                                r"max abs diff [0-9.e-]+ exceeds atol") as err:
        pipe(small_graph())
    assert [c[0] for c in CALLS] == ["_exact_scale_pass"] * 2  # step 3 did not run
    report = err.value.report
    assert [s.name for s in report.steps] == ["_exact_scale_pass", "_exact_scale_pass"]
    assert report[0].contract.ok and report[0].contract.max_abs == 0.0
    assert not report[1].contract.ok and report[1].contract.max_abs > 1e-3
    _, report = pipe(small_graph(), verify=False)  # checks off: nothing measured, nothing refused
    assert [s.contract.kind for s in report.steps] == ["off", "off", "off"] and report.check_forwards == 0


def test_user_thresholds_make_a_bounded_contract_fail() -> None:
    ok, report = Pipeline([("_bounded_scale_pass", {"factor": 1.01}, {"min_sqnr_db": 20.0})])(small_graph())
    assert report[0].contract.ok and report[0].contract.sqnr_db > 20
    assert report[0].contract.limits == {"min_sqnr_db": 20.0}
    with pytest.raises(ContractViolation, match=r"_bounded_scale_pass\) bounded contract: SQNR [0-9.]+ dB < "
                                                r"min_sqnr_db 60 dB"):
        Pipeline([("_bounded_scale_pass", {"factor": 1.01}, {"min_sqnr_db": 60})])(small_graph())
    with pytest.raises(ContractViolation, match=r"max abs diff [0-9.e-]+ > max_abs 1e-09"):
        Pipeline([("_bounded_scale_pass", {"factor": 1.01}, {"max_abs": 1e-9})])(small_graph())


def test_at_most_one_extra_forward_per_step() -> None:
    steps = ["_mark_pass", "_exact_scale_pass", "_needs_mark_pass", "_bounded_scale_pass", "_exact_scale_pass"]
    _, report = Pipeline(steps)(small_graph())
    # one baseline forward, then one per checked transform ("after", reused as the next "before", also
    # across the analysis pass, which leaves the tensors alone)
    assert [s.contract.forwards for s in report.steps] == [0, 2, 0, 1, 1]
    assert report.check_forwards == 4
    assert [s.contract.kind for s in report.steps] == ["none", "exact", "analysis", "bounded", "exact"]
    batches = [(torch.randn(2, 4),), (torch.randn(3, 4),)]
    _, report = Pipeline(steps, num_batches=None)(small_graph(), data=batches)
    assert report.check_forwards == 8  # the same, per batch
    # a transform without a contract changes the weights: the next check needs a fresh "before"
    _, report = Pipeline(["_exact_scale_pass", "_mark_pass", "_exact_scale_pass"])(small_graph())
    assert [s.contract.forwards for s in report.steps] == [2, 0, 2]


def test_report_is_data_and_a_table_and_history_records_the_pipeline() -> None:
    graph = small_graph()
    start = time.perf_counter()
    mg, report = Pipeline([("_bounded_scale_pass", {"factor": 2.0}), "_exact_scale_pass"], name="demo")(graph)
    wall = time.perf_counter() - start
    data = json.loads(json.dumps(report.to_json()))
    step = data["steps"][0]
    assert step["pass"] == "_bounded_scale_pass" and step["args"] == {"factor": 2.0}
    assert step["info"] == {"factor": 2.0, "changed": True}
    # seconds: each pass alone, in seconds (not ms), within the run; the contract checks' time is kept apart
    assert all(s["seconds"] > 0 for s in data["steps"]) and data["seconds"] <= wall
    assert sum(s["seconds"] for s in data["steps"]) + data["check_seconds"] <= data["seconds"]
    assert step["contract"]["kind"] == "bounded" and step["contract"]["max_abs"] > 0
    text = str(report)
    assert "pipeline demo" in text and "_bounded_scale_pass" in text and "exact ok" in text
    assert "contract checks: 3 forward(s)" in text
    record = mg.history[0]
    assert record.name == record.kind == PIPELINE_RECORD
    assert record.args["name"] == "demo" and record.args["records"] == 2
    assert [s["pass"] for s in record.args["steps"]] == ["_bounded_scale_pass", "_exact_scale_pass"]
    assert [r.name for r in mg.history[1:]] == ["_bounded_scale_pass", "_exact_scale_pass"]


def test_from_dict_refuses_unknown_keys() -> None:
    with pytest.raises(PipelineError, match=r"unknown pipeline key\(s\) \['stepz'\]; allowed keys"):
        Pipeline.from_dict({"stepz": []})
    with pytest.raises(PipelineError, match=r"step 1: unknown key\(s\) \['arg'\]; allowed keys"):
        Pipeline.from_dict({"steps": [{"pass": "_mark_pass", "arg": {}}]})
    pipe = Pipeline.from_dict({"name": "d", "verify": False, "steps": [{"pass": "_mark_pass", "args": {"factor": 3}}]})
    assert pipe.to_dict() == {"name": "d", "verify": False, "num_batches": 1,
                              "steps": [{"pass": "_mark_pass", "args": {"factor": 3}}]}
    assert pipe.steps[0].built.factor == 3.0


def test_pass_functions_as_steps_and_checks_need_batches() -> None:
    from fxforge.passes.base import get_pass

    pipe = Pipeline([get_pass("_exact_scale_pass"), (get_pass("_bounded_scale_pass"), {"factor": 2.0})])
    assert [s.name for s in pipe.steps] == ["_exact_scale_pass", "_bounded_scale_pass"]
    mg = small_graph()
    mg.example_inputs = None
    with pytest.raises(PipelineError, match=r"contract checks need batches: no data.*verify=False"):
        pipe(mg)
    out, report = pipe(mg, data=[(torch.randn(2, 4),)])
    assert report[1].contract.max_abs > 0
    _, report = pipe(mg, verify=False)
    assert report.check_forwards == 0
