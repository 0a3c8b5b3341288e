"""Tiny HF Llama, GPT-2 and ViT (random, offline; tests/hf_tiny.py) export to ONNX and to an AOTInductor package
through fxforge.deploy and pass the subprocess check at two input shapes (the zoo models: test_deploy_zoo.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from deploy_sweep import AOTI, assert_deployed
from hf_tiny import INPUT_NAMES, tiny_hf

from fxforge import ForgeGraph


@functools.cache
def hf_graph(family: str) -> ForgeGraph:
    """The tiny ``family`` model captured with its inputs, labels included (the export drops them)."""
    return ForgeGraph(tiny_hf(family), hf_input_names=INPUT_NAMES[family]).eval()


@pytest.mark.parametrize("fmt", ["onnx", AOTI])
@pytest.mark.parametrize("family", ["llama", "gpt2", "vit"])
def test_tiny_hf_model_deploys_and_passes_the_subprocess_check(family: str, fmt: str, tmp_path: Path) -> None:
    manifest = assert_deployed(hf_graph(family), fmt, tmp_path / f"{family}-{fmt}", f"tiny {family}")
    assert manifest.inputs == tuple(n for n in INPUT_NAMES[family] if n != "labels")
