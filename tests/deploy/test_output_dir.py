"""Deploy output directories: bad paths refused naming the path (before any export work), a non-artifact
directory never touched, a previous deploy directory replaced whole."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.deploy import DeployError, export_onnx, read_manifest
from fxforge.deploy.output_dir import StagedDir, check_output_dir


@pytest.fixture(scope="module")
def gpt() -> ForgeGraph:
    return ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 16))).eval()


def test_existing_file_refused(tmp_path: Path, gpt: ForgeGraph) -> None:
    file = tmp_path / "model.onnx"
    file.write_text("mine")
    start = time.perf_counter()
    with pytest.raises(DeployError, match=f"{file} is an existing file"):
        export_onnx(gpt, file)
    assert time.perf_counter() - start < 2  # refused before torch.export runs
    assert file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_path_under_a_file_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DeployError, match=f"{tmp_path / 'notes.txt'} is a file, not a directory"):
        check_output_dir(tmp_path / "notes.txt" / "out")


def test_non_artifact_directory_never_touched(tmp_path: Path, gpt: ForgeGraph) -> None:
    out = tmp_path / "project"
    (out / "src").mkdir(parents=True)
    (out / "train.py").write_text("print(1)")
    (out / "src" / "data.bin").write_bytes(b"\0" * 8)
    with pytest.raises(DeployError, match=f"{out} is a non-empty directory that is not a deploy directory.*never "
                                          "deleted"):
        export_onnx(gpt, out)
    assert (out / "train.py").read_text() == "print(1)" and (out / "src" / "data.bin").read_bytes() == b"\0" * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no staged sibling left behind


def test_deploy_dir_with_extra_files_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "deploy.json").write_text("{}")
    (out / "results.csv").write_text("keep")
    with pytest.raises(DeployError, match="results.csv"):
        check_output_dir(out)


def test_symlink_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(DeployError, match="symlink"):
        check_output_dir(tmp_path / "link")


def test_staged_dir_discard_leaves_nothing(tmp_path: Path) -> None:
    staged = StagedDir(tmp_path / "new" / "out")  # parents are created
    (staged.path / "model.onnx").write_bytes(b"x")
    staged.discard()
    assert list((tmp_path / "new").iterdir()) == []


def test_previous_deploy_dir_replaced_and_empty_dir_used(tmp_path: Path, gpt: ForgeGraph) -> None:
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is fine
    first = export_onnx(gpt, out, check=False, dynamic_seq=False, source="first")
    assert first.dynamic_axes == {"idx": {0: "batch"}, "output_0": {0: "batch"}}
    second = export_onnx(gpt, out, check=False, source="second")
    assert read_manifest(out) == second and second.source == "second"
    assert second.dynamic_axes == {"idx": {0: "batch", 1: "seq"}, "output_0": {0: "batch", 1: "seq"}}
    assert sorted(p.name for p in out.iterdir()) == ["deploy.json", "model.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # staged and previous directories removed
