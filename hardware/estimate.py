"""Resources and cycles of an emitted design, from the hardware IR and the modules' documented timing.

Per layer: multipliers (and their operand widths), adder bits, memory bits (weight / bias ROMs, the linear's
input buffer, FIFOs), the cycle each output beat leaves for a vector whose first input beat enters at cycle 0
(no backpressure: one vector in flight), and the initiation interval (cycles a layer is busy per vector).
The timing follows the RTL exactly: ``fixed_linear`` takes its input beats, then per output block spends one
cycle per input beat and one to emit; ``fixed_argmax`` emits one cycle after its last beat; requant, ReLU, add
and fork are combinational; a FIFO delays a beat by one cycle. So the latency equals the simulated one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .ir import HwGraph, HwLayer

__all__ = ["Resources", "DesignTotals", "LayerEstimate", "DesignEstimate", "estimate_design", "resource_fields"]


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What a layer (or, summed, the design) costs, and its initiation interval: the one definition of these
    fields, which the per-layer estimate, the totals, the pass's node record and its info all share."""

    multipliers: int = 0
    adder_bits: int = 0
    weight_memory_bits: int = 0
    buffer_bits: int = 0
    initiation_interval: int = 0


@dataclass(frozen=True, kw_only=True)
class DesignTotals(Resources):
    """The design's resources (summed over layers; initiation interval: the busiest layer's) and its latency."""

    latency_cycles: int = 0
    clock_mhz: float = 100.0


def resource_fields(source: Any, fields_of: type = Resources) -> dict[str, Any]:
    """``source``'s values of the fields ``fields_of`` defines (to build a record or info from an estimate)."""
    return {f.name: getattr(source, f.name) for f in fields(fields_of)}


@dataclass(frozen=True)
class LayerEstimate(Resources):
    """One layer's resources and timing (cycles counted from the vector's first input beat)."""

    name: str
    kind: str
    multiplier_bits: tuple[int, int] = (0, 0)  # operand widths (data, weight)
    first_out: int = 0
    last_out: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DesignEstimate(DesignTotals):
    """All layers, totals, and the latency in cycles and in microseconds at ``clock_mhz``."""

    layers: list[LayerEstimate] = field(default_factory=list)

    @property
    def latency_us(self) -> float:
        return self.latency_cycles / self.clock_mhz

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency_us"] = self.latency_us
        return out


def _after(times: list[int], delay: int = 0) -> list[int]:
    """Beat times ``delay`` cycles later, one beat per cycle at most."""
    out: list[int] = []
    for t in times:
        out.append(max(t + delay, out[-1] + 1 if out else t + delay))
    return out


def estimate_design(hw: HwGraph, clock_mhz: float = 100.0) -> DesignEstimate:
    """Resources and cycles of ``hw`` as ``emit_design`` builds it (forks get one-vector FIFOs per branch)."""
    beats: dict[str, list[int]] = {}  # layer -> cycle each output beat is taken
    layers: list[LayerEstimate] = []
    for name, layer in hw.layers.items():
        ins = [_inlet(hw, src, name, beats[src]) for src in layer.inputs]
        est, times = _layer(hw, name, layer, ins)
        beats[name] = times
        layers.append(est)
        users = hw.users(name)
        if len(users) > 1:  # the fork's FIFOs: one vector per branch
            fifo_bits = len(users) * layer.size * layer.fmt.width
            layers.append(LayerEstimate(f"{name}_fork", "fork", buffer_bits=fifo_bits, first_out=times[0] + 1,
                                        last_out=times[-1] + 1, initiation_interval=len(times)))
    sums = {f.name: sum(getattr(e, f.name) for e in layers) for f in fields(Resources)
            if f.name != "initiation_interval"}  # the design is as busy as its busiest layer, not their sum
    return DesignEstimate(layers=layers, latency_cycles=beats[hw.output][-1], clock_mhz=float(clock_mhz),
                          initiation_interval=max(e.initiation_interval for e in layers), **sums)


def _inlet(hw: HwGraph, src: str, dst: str, times: list[int]) -> list[int]:
    """Beat times as ``dst`` sees ``src``'s stream: through a FIFO (one cycle) when ``src`` is forked."""
    return _after(times, 1) if len(hw.users(src)) > 1 else times


def _layer(hw: HwGraph, name: str, layer: HwLayer, ins: list[list[int]]) -> tuple[LayerEstimate, list[int]]:
    kind, par = layer.kind, layer.parallelism
    if kind == "input":
        times = list(range(layer.size // par))  # the testbench offers a beat every cycle
        return LayerEstimate(name, kind, initiation_interval=len(times), last_out=times[-1]), times
    src = hw.layers[layer.inputs[0]]
    if kind == "linear":
        assert layer.weight_fmt is not None
        b_in, blocks = src.size // src.parallelism, layer.size // par
        last_in = ins[0][-1]
        times = [last_in + (k + 1) * (b_in + 1) for k in range(blocks)]
        bias_bits = layer.size * layer.bias_fmt.width if layer.bias_fmt is not None and layer.bias is not None else 0
        return LayerEstimate(
            name, kind, multipliers=src.parallelism * par, multiplier_bits=(src.fmt.width, layer.weight_fmt.width),
            adder_bits=src.parallelism * par * layer.fmt.width,
            weight_memory_bits=layer.size * src.size * layer.weight_fmt.width + bias_bits,
            buffer_bits=src.size * src.fmt.width + par * layer.fmt.width, first_out=times[0], last_out=times[-1],
            initiation_interval=b_in + blocks * (b_in + 1)), times
    if kind == "argmax":
        times = [ins[0][-1] + 1]
        return LayerEstimate(name, kind, adder_bits=src.parallelism * src.fmt.width,
                             buffer_bits=src.fmt.width + layer.fmt.width, first_out=times[0], last_out=times[0],
                             initiation_interval=len(ins[0]) + 1), times
    if kind == "add":
        times = _after([max(a, b) for a, b in zip(ins[0], ins[1])])
        adder = par * layer.fmt.width
    elif kind == "requant":
        times = list(ins[0])
        adder = par * layer.fmt.width if layer.fmt.frac < src.fmt.frac else 0  # the rounding increment
    elif kind == "relu":
        times, adder = list(ins[0]), 0
    else:
        raise ValueError(f"layer {name!r}: unknown kind {kind!r}")
    return LayerEstimate(name, kind, adder_bits=adder, first_out=times[0], last_out=times[-1],
                         initiation_interval=len(times)), times
