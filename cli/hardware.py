"""CLI commands ``emit-verilog`` (a fixed-point checkpoint as SystemVerilog) and ``simulate-verilog`` (run it).

Both are thin: the work is ``emit_verilog_transform_pass`` and ``fxforge.hardware.simulate.simulate_design``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError

__all__ = ["emit_verilog", "simulate_verilog", "parse_parallelism"]


def parse_parallelism(items: list[str]) -> dict[str, int]:
    """``["fc1=4", "data_in_0=2"]`` -> ``{"fc1": 4, "data_in_0": 2}``; CliError naming a malformed item."""
    out: dict[str, int] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value.isdigit() or int(value) < 1:
            raise CliError(f"--parallelism {item!r}: expected NAME=N with N >= 1 (a Linear node or data_in_0)")
        out[name] = int(value)
    return out


@app.command("emit-verilog")
def emit_verilog(
    ckpt: Annotated[Path, typer.Argument(help="An fxforge checkpoint quantized to fixed point.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Directory for the sources, ROM files and design.json.")],
    top: Annotated[str, typer.Option("--top", help="Name of the top module.")] = "top",
    parallelism: Annotated[list[str] | None, typer.Option(
        "--parallelism", "-p", help="NAME=N: elements per beat of a Linear's output (or data_in_0); repeatable.")]
    = None,
) -> None:
    """Write CKPT's fixed-point layers as streaming SystemVerilog (MASE's interface) into OUT."""
    from ..graph.forge_graph import ForgeGraph
    from ..hardware import emit_verilog_transform_pass

    mg = ForgeGraph.from_checkpoint(ckpt)
    _, info = emit_verilog_transform_pass(mg, {"out_dir": str(out), "top": top,
                                               "parallelism": parse_parallelism(parallelism or [])})
    typer.echo(f"emitted {len(info.layers) - 1} layers of {ckpt} as {info.top} to {out}: {', '.join(info.sources)}")


@app.command("simulate-verilog")
def simulate_verilog(
    design: Annotated[Path, typer.Argument(help="A directory written by emit-verilog.")],
    input_path: Annotated[Path, typer.Option("--input", help="safetensors file: one tensor (n, features); float "
                                                             "values are quantized to the design's input format, "
                                                             "integer ones are taken as its integers.")],
    output_path: Annotated[Path, typer.Option("--output", help="safetensors file to write: 'integers' (the RTL's "
                                                               "outputs), 'values' (dequantized) and 'latency' "
                                                               "(cycles per vector).")],
    simulator: Annotated[str | None, typer.Option("--simulator", help="verilator or icarus (default: what is "
                                                                      "installed, verilator first).")] = None,
    build_dir: Annotated[Path | None, typer.Option("--build-dir", help="Where simulator builds are cached.")] = None,
) -> None:
    """Run DESIGN under Verilator or Icarus with fxforge's cocotb testbench on INPUT and write OUTPUT."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..hardware.ir import Fixed
    from ..hardware.reference import quantize_input
    from ..hardware.simulate import simulate_design

    spec = json.loads((design / "design.json").read_text())
    tensors = load_file(str(input_path))
    if len(tensors) != 1:
        raise CliError(f"{input_path}: expected one tensor, found {sorted(tensors)}")
    x = next(iter(tensors.values()))
    fin = Fixed(spec["input"]["width"], spec["input"]["frac"])
    x_int = quantize_input(x, fin) if x.is_floating_point() else x.to(torch.int64)
    res = simulate_design(design, x_int.reshape(-1, spec["input"]["size"]), simulator=simulator, build_root=build_dir)
    out = spec["output"]
    values = res.outputs.double() * 2.0 ** -out["frac"] if out["kind"] != "argmax" else res.outputs[:, 0].clone()
    save_file({"integers": res.outputs.contiguous(), "values": values.contiguous(),
               "latency": torch.tensor(res.latencies, dtype=torch.int64)}, str(output_path))
    typer.echo(f"simulated {len(res.outputs)} vectors on {res.simulator} (build {res.build_seconds:.1f} s, "
               f"simulation {res.sim_seconds:.1f} s): {output_path}")
