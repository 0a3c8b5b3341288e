"""The zoo's GPT (attention), AFNO-GPT (FFT token mixer) and AGRU export to ONNX and to an AOTInductor package
and pass the subprocess check at two input shapes (the sweep's second file: see deploy_sweep.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_sweep import AOTI, MIXER_ZOO, assert_deployed, zoo_graph


@pytest.mark.parametrize("fmt", ["onnx", AOTI])
@pytest.mark.parametrize("name", MIXER_ZOO)
def test_mixer_zoo_model_deploys_and_passes_the_subprocess_check(name: str, fmt: str, tmp_path: Path) -> None:
    assert_deployed(zoo_graph(name), fmt, tmp_path / f"{name}-{fmt}", name)
