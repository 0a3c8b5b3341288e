"""cocotb testbench of an fxforge-emitted design (run by hardware/simulate.py through cocotb's runner).

Reads ``FXFORGE_TB_CONFIG`` (JSON: the design's input/output streams, the input vectors, stall
probabilities, seed, whether to wait for each output before the next input), drives ``data_in_0`` beat by
beat and collects ``data_out_0``, sampling once per cycle on the falling edge (the design's input ready and
output valid depend on its registers only), then writes ``FXFORGE_TB_RESULT`` (JSON: outputs and, per
vector, the cycle its first input beat and its last output beat were taken). Kept free of fxforge imports,
so the simulator's Python starts fast.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge


@cocotb.test()
async def stream_vectors(dut) -> None:  # noqa: ANN001 - cocotb's handle to the top module
    """Every input vector in, every output vector out; fails on a timeout."""
    cfg = json.loads(Path(os.environ["FXFORGE_TB_CONFIG"]).read_text())
    p_in, p_out = cfg["input"]["parallelism"], cfg["output"]["parallelism"]
    beats_in = cfg["input"]["size"] // p_in
    beats_out = cfg["output"]["size"] // p_out
    vectors = cfg["inputs"]
    rng = random.Random(cfg.get("seed", 0))
    stall_in, stall_out = cfg.get("stall_in", 0.0), cfg.get("stall_out", 0.0)
    one_at_a_time = cfg.get("one_at_a_time", False)
    max_cycles = cfg["max_cycles"]
    din = [dut.data_in_0[i] for i in range(p_in)]
    dout = [dut.data_out_0[i] for i in range(p_out)]

    Clock(dut.clk, 10, unit="ns").start(start_high=False)
    dut.rst.value = 1
    dut.data_in_0_valid.value = 0
    dut.data_out_0_ready.value = 0
    for h in din:
        h.value = 0
    for _ in range(3):
        await FallingEdge(dut.clk)
    dut.rst.value = 0

    outputs: list[list[int]] = []
    current: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    vec, beat = 0, 0
    for cycle in range(max_cycles):
        await FallingEdge(dut.clk)
        # outputs: a beat is taken at the next rising edge when valid (now) and our ready (set now)
        ready = rng.random() >= stall_out
        if ready and dut.data_out_0_valid.value:
            current.extend(h.value.to_signed() for h in dout)
            if len(current) == beats_out * p_out:
                outputs.append(current)
                ends.append(cycle)
                current = []
        dut.data_out_0_ready.value = int(ready)
        if len(outputs) == len(vectors):
            return_results(cfg, outputs, starts, ends)
            return
        # inputs: drive the pending beat; the design takes it at the next rising edge if ready now
        waiting = one_at_a_time and vec > len(outputs)
        if vec < len(vectors) and not waiting and rng.random() >= stall_in:
            for i, h in enumerate(din):
                h.value = vectors[vec][beat * p_in + i]
            dut.data_in_0_valid.value = 1
            if dut.data_in_0_ready.value:
                if beat == 0:
                    starts.append(cycle)
                beat += 1
                if beat == beats_in:
                    vec, beat = vec + 1, 0
        else:
            dut.data_in_0_valid.value = 0
    raise AssertionError(f"timeout after {max_cycles} cycles: {len(outputs)} of {len(vectors)} outputs, "
                         f"{vec} inputs sent")


def return_results(cfg: dict, outputs: list[list[int]], starts: list[int], ends: list[int]) -> None:
    """Write the outputs and cycle stamps where simulate.py reads them."""
    Path(os.environ["FXFORGE_TB_RESULT"]).write_text(json.dumps(
        {"outputs": outputs, "start": starts, "end": ends, "n": len(cfg["inputs"])}))
