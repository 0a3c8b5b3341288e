"""The deploy sweep's model lists and assertion, shared by test_deploy_zoo.py (the BERT zoo models),
test_deploy_zoo_mixers.py (GPT, AFNO-GPT, AGRU) and test_deploy_zoo_hf.py (tiny HF Llama, GPT-2, ViT): three files
of about equal time (each model costs an ONNX export and an AOTInductor compile, 10-90 s) so pytest-xdist's
loadfile spreads them over the workers.

The AOTInductor half is marked ``slow_deploy``: its eight C++ compiles (~4 minutes of CPU) would take `make test`
past its 12-minute budget, so `make test-deploy` runs it and `.ci/run` runs both (`make test` keeps the ONNX half
and one AOTI export, tiny BERT's in test_export_float.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from fxforge import ForgeGraph
from fxforge.deploy import ARTIFACT_FILES, DeployManifest, export_aoti, export_onnx, read_manifest
from fxforge.deploy.export import FLOAT_BOUND
from fxforge.models.zoo import build

BERT_ZOO = ("minilm", "tiny-bert")
MIXER_ZOO = ("gpt", "gpt-afno", "agru")
AOTI = pytest.param("aoti", marks=pytest.mark.slow_deploy)


@functools.cache
def zoo_graph(name: str) -> ForgeGraph:
    """The zoo model ``name`` captured as ``fxforge deploy`` captures it (once per test module: an export never
    changes the caller's graph)."""
    zm = build(name)
    return ForgeGraph(zm.model, **zm.capture).eval()


def assert_deployed(mg: ForgeGraph, fmt: str, out: Path, name: str) -> DeployManifest:
    """Export ``mg`` to ``fmt`` under ``out``; the manifest on disk records a passed check at two different input
    shapes, run without fxforge, every shape within the float bound, with a dynamic batch axis."""
    export = export_onnx if fmt == "onnx" else export_aoti
    manifest = export(mg, out, source=name)
    assert (out / ARTIFACT_FILES[fmt]).is_file() and read_manifest(out) == manifest
    check = manifest.check
    assert check is not None and check.passed and not check.fxforge_importable, check
    assert check.runtime.split()[0] == ("onnxruntime" if fmt == "onnx" else "torch.aoti")
    assert all(s.bound_kind == "relative" and s.error <= FLOAT_BOUND == s.bound for s in check.shapes)
    assert "labels" not in manifest.inputs and "loss" not in manifest.outputs
    assert manifest.dynamic_axes.get(manifest.inputs[0], {}).get(0) == "batch", \
        f"{name}: batch is not a dynamic axis of {manifest.inputs[0]} (dynamic axes {manifest.dynamic_axes})"
    assert len(check.shapes) == 2 and check.shapes[0].shapes != check.shapes[1].shapes, \
        f"{name}: the check ran at {[s.shapes for s in check.shapes]}, not at two different shapes"
    return manifest
