"""hardware_estimate_analysis_pass: resources per layer from the parallelism, the latency model's cycles (the
slow simulation tests check the latency against Verilator's count), records on the nodes, refusals."""

from __future__ import annotations

import pytest
from hw_models import MLP, FFNBlock, fixed_config, quantized

from fxforge.graph.metadata import get_meta
from fxforge.hardware import HardwareEstimateRecord, hardware_estimate_analysis_pass
from fxforge.passes import PassError


def test_mlp_resources_follow_the_parallelism() -> None:
    g = quantized(MLP(), fixed_config(8, 4, 5, 3))
    _, info = hardware_estimate_analysis_pass(g, {"parallelism": {"data_in_0": 2, "fc1": 4, "fc2": 2},
                                                  "clock_mhz": 250.0})
    fc1, fc2 = info.layers["fc1"], info.layers["fc2"]
    assert fc1["multipliers"] == 2 * 4 and fc2["multipliers"] == 4 * 2 and info.multipliers == 16
    assert fc1["multiplier_bits"] == (8, 8)
    assert fc1["weight_memory_bits"] == 16 * 8 * 8 + 16 * 8 and fc2["weight_memory_bits"] == 4 * 16 * 8 + 4 * 8
    # fc1: 4 input beats (8 / 2), then 4 blocks of (4 compute + 1 emit); fc2 collects fc1's last beat, then
    # 2 blocks of (4 + 1); argmax one cycle after fc2's last beat
    assert fc1["last_out"] == 3 + 4 * 5 and fc2["last_out"] == fc1["last_out"] + 2 * 5
    assert info.latency_cycles == fc2["last_out"] + 1 and info.latency_us == info.latency_cycles / 250.0
    assert fc1["initiation_interval"] == 4 + 4 * 5 and info.initiation_interval == 4 + 4 * 5
    rec = get_meta(next(n for n in g.nodes if n.name == "fc1")).hardware.get(HardwareEstimateRecord)
    assert rec is not None and rec.multipliers == 8 and rec.parallelism == 4


def test_more_parallelism_fewer_cycles_more_multipliers() -> None:
    g = quantized(MLP(), fixed_config(8, 4, 5, 3))
    _, slow = hardware_estimate_analysis_pass(g, {})
    _, fast = hardware_estimate_analysis_pass(g, {"parallelism": {"data_in_0": 8, "fc1": 16, "fc2": 4}})
    assert slow.multipliers == 2 and fast.multipliers == 8 * 16 + 16 * 4
    assert fast.latency_cycles < slow.latency_cycles


def test_ffn_block_fork_fifos_are_counted() -> None:
    g = quantized(FFNBlock(head=False), fixed_config(8, 4, 5, 3))
    _, info = hardware_estimate_analysis_pass(g, {"parallelism": {"data_in_0": 2, "fc1": 4, "fc2": 2}})
    assert info.layers["input_fork"]["buffer_bits"] == 2 * 8 * 8
    assert info.latency_cycles == info.layers["add"]["last_out"]


def test_unsupported_graph_is_refused() -> None:
    g = quantized(MLP(), {"by": "type", "default": {"config": {"name": "mxint", "data_in_width": 8,
                                                                "weight_width": 8}}})
    with pytest.raises(PassError, match="'mxint'"):
        hardware_estimate_analysis_pass(g, {})


def test_record_and_totals_carry_every_resource_of_the_estimate() -> None:
    # the record and the info's totals are built from the estimate's field definitions: each field, on each node,
    # must hold that layer's value (a field dropped or misnamed would leave a default 0 here), totals the sums
    from dataclasses import fields

    from fxforge.graph.metadata import MetaSection
    from fxforge.hardware.estimate import Resources

    g = quantized(FFNBlock(head=False), fixed_config(8, 4, 5, 3))
    _, info = hardware_estimate_analysis_pass(g, {"parallelism": {"data_in_0": 2, "fc1": 4, "fc2": 2}})
    names = [f.name for f in fields(Resources)]
    assert {"multipliers", "adder_bits", "weight_memory_bits", "buffer_bits", "initiation_interval"} <= set(names)
    for name in names:
        per_layer = [layer[name] for layer in info.layers.values()]
        want = max(per_layer) if name == "initiation_interval" else sum(per_layer)
        assert getattr(info, name) == want > 0, name
    assert info.to_json()["latency_cycles"] == info.latency_cycles == info.layers["add"]["last_out"]
    checked = 0
    for node in g.nodes:
        rec = get_meta(node).hardware.get(HardwareEstimateRecord)
        if rec is None:
            continue
        layer = info.layers[node.name]
        assert {n: getattr(rec, n) for n in names} == {n: layer[n] for n in names}
        assert (rec.kind, rec.last_out_cycle) == (layer["kind"], layer["last_out"])
        back = MetaSection.from_json(get_meta(node).hardware.to_json()).get(HardwareEstimateRecord)
        assert back == rec  # the record survives a checkpoint's JSON round trip
        checked += 1
    assert checked >= 3  # fc1, fc2 and add at least
