"""Export is crash-safe and never deletes what it did not write (both checkpoint kinds share the writer)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from security_helpers import tiny_graph

from fxforge import CheckpointError, ForgeGraph, passes
from fxforge.graph import atomic
from fxforge.graph.checkpoint import FORMAT
from fxforge.passes.lora_checkpoint import load_lora_adapters, save_lora_adapters

STEPS = ["tmp_created", "wrote:graph.json", "wrote:weights.safetensors", "wrote:manifest.json", "synced",
         "swapped", "cleaned"]


@pytest.fixture(scope="module")
def graphs() -> tuple[ForgeGraph, ForgeGraph]:
    old = tiny_graph("fx")
    new = old.copy()
    with torch.no_grad():
        new.model.fc.weight.add_(1.0)
    return old, new


def _kill_at(step: str, kind: str, *paths: Path) -> int:
    """Write a checkpoint in a fresh process (tests/security/kill_child.py) that SIGKILLs itself at ``step``;
    its return code (-SIGKILL when the step was reached)."""
    child = Path(__file__).with_name("kill_child.py")
    proc = subprocess.run([sys.executable, str(child), kind, step, *map(str, paths)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return proc.returncode


@pytest.mark.parametrize("step", STEPS)
def test_killed_graph_export_leaves_old_or_new(graphs: tuple[ForgeGraph, ForgeGraph], tmp_path: Path,
                                               step: str) -> None:
    old, new = graphs
    path = old.export(tmp_path / "ckpt")
    x = torch.randn(2, 4)
    source = new.export(tmp_path / "new")
    assert _kill_at(step, "graph", source, path) == -signal.SIGKILL
    out = ForgeGraph.from_checkpoint(path)(x)
    before_swap = STEPS.index(step) < STEPS.index("swapped")
    assert torch.equal(out, (old if before_swap else new)(x))
    assert new.export(path) == path  # the leftover temporary directory never blocks the next export
    assert torch.equal(ForgeGraph.from_checkpoint(path)(x), new(x))


@pytest.mark.parametrize("step", ["wrote:adapter_config.json", "wrote:adapter_weights.safetensors", "synced",
                                  "swapped"])
def test_killed_lora_save_leaves_old_or_new(graphs: tuple[ForgeGraph, ForgeGraph], tmp_path: Path,
                                            step: str) -> None:
    base = graphs[0]
    adapted = []
    for seed in (1, 2):
        mg = base.copy()
        mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "targets": {"name": ["fc"]}})
        with torch.no_grad():
            mg.model.fc.lora_B.normal_(generator=torch.Generator().manual_seed(seed))
        adapted.append(mg)
    path = save_lora_adapters(adapted[0], tmp_path / "lora")
    base_ckpt = base.export(tmp_path / "base")
    source = save_lora_adapters(adapted[1], tmp_path / "lora-new")
    assert _kill_at(step, "lora", base_ckpt, source, path) == -signal.SIGKILL
    loaded, _ = load_lora_adapters(base.copy(), path)
    expect = adapted[0] if step != "swapped" else adapted[1]
    assert torch.equal(loaded.model.fc.lora_B, expect.model.fc.lora_B)


def test_directory_named_like_a_checkpoint_file_is_never_deleted(graphs: tuple[ForgeGraph, ForgeGraph],
                                                                 tmp_path: Path) -> None:
    path = graphs[0].export(tmp_path / "ckpt")
    (path / "weights.safetensors").unlink()
    (path / "weights.safetensors").mkdir()
    (path / "weights.safetensors" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not files of an fxforge checkpoint.*weights.safetensors"):
        graphs[1].export(path)
    assert (path / "weights.safetensors" / "precious.txt").read_text() == "keep me"


def test_symlink_targets_and_empty_paths_are_refused(graphs: tuple[ForgeGraph, ForgeGraph], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = graphs[0].export(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(CheckpointError, match="symbolic link"):
        graphs[1].export(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and not list(tmp_path.glob("*.old"))
    monkeypatch.chdir(tmp_path / "real")
    for bad in (".", "", "..", tmp_path / "x" / ".."):
        with pytest.raises(CheckpointError, match="not a valid checkpoint path"):
            graphs[1].export(bad)


def test_symlinked_file_in_the_target_is_refused(graphs: tuple[ForgeGraph, ForgeGraph], tmp_path: Path) -> None:
    path = graphs[0].export(tmp_path / "ckpt")
    (tmp_path / "elsewhere").write_text("not ours")
    (path / "metadata.json").unlink()
    (path / "metadata.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="not files of an fxforge checkpoint"):
        graphs[1].export(path)
    assert (tmp_path / "elsewhere").read_text() == "not ours"


def test_permissions_follow_the_umask(graphs: tuple[ForgeGraph, ForgeGraph], tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = graphs[0].export(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert stat.S_IMODE((path / "graph.json").stat().st_mode) == 0o644


def test_writer_refuses_a_regular_file_target(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        atomic.write_checkpoint_dir(tmp_path / "file", {"graph.json": b"{}"}, FORMAT, 2)
    assert (tmp_path / "file").read_text() == "x"
