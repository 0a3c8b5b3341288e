"""Write a hardware graph as SystemVerilog: one module instance per layer, a top with MASE's interface.

The top module has ``clk``, ``rst`` (synchronous, active high), ``data_in_0`` / ``data_in_0_valid`` /
``data_in_0_ready`` and ``data_out_0`` / ``data_out_0_valid`` / ``data_out_0_ready``, with MASE's parameter
names (``DATA_IN_0_PRECISION_0`` = width, ``_PRECISION_1`` = fraction width, ``_TENSOR_SIZE_DIM_0``,
``_PARALLELISM_DIM_0``). Layers are the library modules of ``hardware/modules``; a value used twice goes
through a ``stream_fork`` with a FIFO of one vector per branch (so a residual branch never blocks); the modules
they instantiate (the shared handshakes ``stream_join`` / ``stream_sequencer``) are shipped beside them. Weights
and biases are ``$readmemh`` files beside the sources; ``design.json`` describes the design for the testbench.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ir import Fixed, HwGraph, HwLayer
from .rom import linear_bias_lanes, linear_weight_lanes, write_mem

__all__ = ["EmittedDesign", "emit_design", "MODULE_DIR", "DESIGN_FILE"]

MODULE_DIR = Path(__file__).parent / "modules"
DESIGN_FILE = "design.json"
_MODULES = {"requant": "fixed_requant", "linear": "fixed_linear", "relu": "fixed_relu", "add": "fixed_add",
            "argmax": "fixed_argmax"}


@dataclass(frozen=True)
class EmittedDesign:
    """What was written: the directory, top module, SystemVerilog sources (in compile order) and ROM files."""

    out_dir: Path
    top: str
    sources: tuple[str, ...]
    roms: tuple[str, ...]
    source_hash: str  # SHA-256 over the sources (not the ROMs): one simulator build per hash


def _ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def _params(p: dict[str, Any]) -> str:
    items = [f".{k}({json.dumps(v) if isinstance(v, str) else v})" for k, v in p.items()]
    return "#(\n      " + ",\n      ".join(items) + "\n  )"


def _ports(ports: dict[str, str]) -> str:
    return "(\n      " + ",\n      ".join(f".{k}({v})" for k, v in ports.items()) + "\n  )"


class _Top:
    """Accumulates declarations and instances of the top module."""

    def __init__(self, hw: HwGraph) -> None:
        self.hw = hw
        self.decls: list[str] = []
        self.body: list[str] = []
        self.used: set[str] = set()
        self.roms: list[tuple[str, Any, int]] = []
        self.inlet: dict[tuple[str, str], str] = {}  # (producer, consumer) -> stream name the consumer reads

    def stream(self, name: str, fmt: Fixed, par: int) -> str:
        self.decls += [f"  logic signed [{fmt.width - 1}:0] {name} [{par}];", f"  logic {name}_valid;",
                       f"  logic {name}_ready;"]
        return name

    def instance(self, module: str, inst: str, params: dict[str, Any], ports: dict[str, str]) -> None:
        self.used.add(module)
        self.body.append(f"  {module} {_params(params)} {inst} {_ports(ports)};")

    def connect(self, ports: dict[str, str], port: str, stream: str, out: bool) -> None:
        ports[port] = stream
        ports[f"{port}_valid"] = f"{stream}_valid"
        ports[f"{port}_ready"] = f"{stream}_ready"
        del out  # direction is the module's; kept for readability at call sites

    def fanout(self, name: str, layer: HwLayer, users: list[str]) -> None:
        """One stream per consumer: forks (chained for 3+) and a one-vector FIFO on each branch."""
        src = f"s_{_ident(name)}"
        if len(users) == 1:
            self.inlet[(name, users[0])] = src
            return
        beats = layer.size // layer.parallelism
        base = {"DATA_IN_0_PRECISION_0": layer.fmt.width, "DATA_IN_0_PARALLELISM_DIM_0": layer.parallelism}
        for k, user in enumerate(users):
            last = k == len(users) - 1
            fed = src
            if not last:
                branch = self.stream(f"{src}_to_{_ident(user)}_raw", layer.fmt, layer.parallelism)
                rest = self.stream(f"{src}_rest{k}", layer.fmt, layer.parallelism)
                ports = {"clk": "clk", "rst": "rst"}
                self.connect(ports, "data_in_0", src, False)
                self.connect(ports, "data_out_0", branch, True)
                self.connect(ports, "data_out_1", rest, True)
                self.instance("stream_fork", f"u_fork_{_ident(name)}_{k}", base, ports)
                fed = branch
            out = self.stream(f"{src}_to_{_ident(user)}", layer.fmt, layer.parallelism)
            ports = {"clk": "clk", "rst": "rst"}
            self.connect(ports, "data_in_0", fed, False)
            self.connect(ports, "data_out_0", out, True)
            self.instance("stream_fifo", f"u_fifo_{_ident(name)}_{_ident(user)}", {**base, "DEPTH": beats}, ports)
            self.inlet[(name, user)] = out
            if not last:
                src = rest

    def layer(self, name: str, layer: HwLayer) -> None:
        module = _MODULES[layer.kind]
        ins = [self.hw.layers[i] for i in layer.inputs]
        first = ins[0]
        p: dict[str, Any] = {"DATA_IN_0_PRECISION_0": first.fmt.width}
        if layer.kind in ("requant", "add", "linear"):
            p["DATA_IN_0_PRECISION_1"] = first.fmt.frac
        if layer.kind == "add":
            p |= {"DATA_IN_1_PRECISION_0": ins[1].fmt.width, "DATA_IN_1_PRECISION_1": ins[1].fmt.frac}
        if layer.kind in ("linear", "argmax"):
            p["DATA_IN_0_TENSOR_SIZE_DIM_0"] = first.size
        p["DATA_IN_0_PARALLELISM_DIM_0"] = first.parallelism
        if layer.kind == "linear":
            assert layer.weight_fmt is not None and layer.weight is not None
            b = layer.bias_fmt or Fixed(1, 0)
            rom = f"{_ident(name)}_weight.mem"
            p = {"HAS_BIAS": int(layer.bias is not None), **p,
                 "WEIGHT_PRECISION_0": layer.weight_fmt.width, "WEIGHT_PRECISION_1": layer.weight_fmt.frac,
                 "BIAS_PRECISION_0": b.width, "BIAS_PRECISION_1": b.frac}
            self.roms.append((rom, linear_weight_lanes(layer.weight, first.parallelism, layer.parallelism),
                              layer.weight_fmt.width))
            if layer.bias is not None:
                brom = f"{_ident(name)}_bias.mem"
                self.roms.append((brom, linear_bias_lanes(layer.bias, layer.parallelism), b.width))
            else:
                brom = "none.mem"
        if layer.kind in ("requant", "add", "linear", "argmax"):
            p["DATA_OUT_0_PRECISION_0"] = layer.fmt.width
        if layer.kind in ("requant", "add", "linear"):
            p["DATA_OUT_0_PRECISION_1"] = layer.fmt.frac
        if layer.kind == "linear":
            p |= {"DATA_OUT_0_TENSOR_SIZE_DIM_0": layer.size, "DATA_OUT_0_PARALLELISM_DIM_0": layer.parallelism,
                  "WEIGHT_ROM": rom, "BIAS_ROM": brom}
        ports = {"clk": "clk", "rst": "rst"}
        for k, src in enumerate(layer.inputs):
            self.connect(ports, f"data_in_{k}", self.inlet[(src, name)], False)
        self.connect(ports, "data_out_0", self.stream(f"s_{_ident(name)}", layer.fmt, layer.parallelism), True)
        self.instance(module, f"u_{_ident(name)}", p, ports)


def _with_submodules(used: set[str]) -> list[str]:
    """``used`` and every library module their sources instantiate, transitively (the shared handshakes
    stream_join / stream_sequencer, fixed_round_saturate), sorted: the modules an emitted design ships."""
    library = {p.stem for p in MODULE_DIR.glob("*.sv")}
    todo, seen = sorted(used), set[str]()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            code = re.sub(r"//[^\n]*|/\*.*?\*/", "", (MODULE_DIR / f"{module}.sv").read_text(), flags=re.S)
            todo += sorted(set(re.findall(r"\b\w+\b", code)) & library - {module})
    return sorted(seen)


def _top_text(top: str, hw: HwGraph, t: _Top) -> str:
    i, o = hw.layers[hw.input], hw.layers[hw.output]
    header = f"""// {top}: emitted by fxforge (hardware/emit.py) from a fixed-point quantized graph; do not edit.
// Layers: {", ".join(f"{n} ({v.kind})" for n, v in hw.layers.items() if v.kind != "input")}
`timescale 1ns / 1ps
module {top} #(
    /* verilator lint_off UNUSEDPARAM */
    parameter int DATA_IN_0_PRECISION_0 = {i.fmt.width},
    parameter int DATA_IN_0_PRECISION_1 = {i.fmt.frac},
    parameter int DATA_IN_0_TENSOR_SIZE_DIM_0 = {i.size},
    parameter int DATA_IN_0_PARALLELISM_DIM_0 = {i.parallelism},
    parameter int DATA_OUT_0_PRECISION_0 = {o.fmt.width},
    parameter int DATA_OUT_0_PRECISION_1 = {o.fmt.frac},
    parameter int DATA_OUT_0_TENSOR_SIZE_DIM_0 = {o.size},
    parameter int DATA_OUT_0_PARALLELISM_DIM_0 = {o.parallelism}
    /* verilator lint_on UNUSEDPARAM */
) (
    input  logic clk,
    input  logic rst,
    input  logic signed [DATA_IN_0_PRECISION_0-1:0] data_in_0 [DATA_IN_0_PARALLELISM_DIM_0],
    input  logic data_in_0_valid,
    output logic data_in_0_ready,
    output logic signed [DATA_OUT_0_PRECISION_0-1:0] data_out_0 [DATA_OUT_0_PARALLELISM_DIM_0],
    output logic data_out_0_valid,
    input  logic data_out_0_ready
);
"""
    src, dst = f"s_{_ident(hw.input)}", f"s_{_ident(hw.output)}"
    glue = [f"  for (genvar i = 0; i < DATA_IN_0_PARALLELISM_DIM_0; i++) begin : g_data_in_0\n"
            f"    assign {src}[i] = data_in_0[i];\n  end",
            f"  assign {src}_valid = data_in_0_valid;", f"  assign data_in_0_ready = {src}_ready;",
            f"  for (genvar i = 0; i < DATA_OUT_0_PARALLELISM_DIM_0; i++) begin : g_data_out_0\n"
            f"    assign data_out_0[i] = {dst}[i];\n  end",
            f"  assign data_out_0_valid = {dst}_valid;", f"  assign {dst}_ready = data_out_0_ready;"]
    return header + "\n".join(t.decls + glue) + "\n\n" + "\n\n".join(t.body) + "\nendmodule\n"


def design_description(hw: HwGraph, top: str) -> dict[str, Any]:
    """What the testbench and the CLI need: the top, input/output formats, sizes and beats, the layers."""
    i, o = hw.layers[hw.input], hw.layers[hw.output]

    def stream(layer: HwLayer) -> dict[str, Any]:
        return {"width": layer.fmt.width, "frac": layer.fmt.frac, "size": layer.size,
                "parallelism": layer.parallelism, "kind": layer.kind}

    return {"format": "fxforge-hardware-1", "top": top, "input": stream(i), "output": stream(o),
            "layers": [{"name": n, "kind": v.kind, "inputs": list(v.inputs), "width": v.fmt.width,
                        "frac": v.fmt.frac, "size": v.size, "parallelism": v.parallelism, "source": v.source}
                       for n, v in hw.layers.items()]}


def emit_design(hw: HwGraph, out_dir: str | Path, top: str = "top") -> EmittedDesign:
    """Write the design's SystemVerilog, ROM files and ``design.json`` into ``out_dir``."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", top):
        raise ValueError(f"top {top!r} must be a SystemVerilog identifier")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = _Top(hw)
    t.stream(f"s_{_ident(hw.input)}", hw.layers[hw.input].fmt, hw.layers[hw.input].parallelism)
    for name, layer in hw.layers.items():
        if layer.kind != "input":
            t.layer(name, layer)
        users = hw.users(name)
        if users:
            t.fanout(name, layer, users)
    if hw.users(hw.output):
        raise ValueError(f"the output layer {hw.output!r} also feeds other layers")
    sources = []
    for module in _with_submodules(t.used):
        shutil.copyfile(MODULE_DIR / f"{module}.sv", out / f"{module}.sv")
        sources.append(f"{module}.sv")
    (out / f"{top}.sv").write_text(_top_text(top, hw, t))
    sources.append(f"{top}.sv")
    roms = []
    for rom, lanes, width in t.roms:
        write_mem(out / rom, lanes, width)
        roms.append(rom)
    digest = hashlib.sha256()
    for s in sources:
        digest.update(s.encode() + b"\0" + (out / s).read_bytes())
    (out / DESIGN_FILE).write_text(json.dumps({**design_description(hw, top), "sources": sources, "roms": roms},
                                              indent=1))
    return EmittedDesign(out, top, tuple(sources), tuple(roms), digest.hexdigest())
