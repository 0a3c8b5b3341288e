"""The simulator build cache is keyed by the design's sources and by the toolchain that builds them: a build
cached by another checkout or venv (whose makefile names that venv's cocotb paths) is not reused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fxforge.hardware.simulate import build_key


def test_build_key_follows_the_sources_and_the_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "top.sv").write_text("module top; endmodule\n")
    design = {"top": "top", "sources": ["top.sv"]}
    key = build_key(design, tmp_path, "verilator")
    assert key == build_key(design, tmp_path, "verilator")  # a rebuild of the same design here is a cache hit
    other = sys.prefix + "-another-checkout"  # another venv (CI's, a colleague's): its makefile names other paths
    monkeypatch.setattr(sys, "prefix", other)
    assert build_key(design, tmp_path, "verilator") != key
    monkeypatch.undo()
    (tmp_path / "top.sv").write_text("module top; wire a; endmodule\n")
    assert build_key(design, tmp_path, "verilator") != key
