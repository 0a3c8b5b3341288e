"""Every zoo model exports to ONNX and to an AOTInductor package through fxforge.deploy and passes the subprocess
check (fxforge not importable there) at two input shapes within the float bound: the BERT models here, the
GPT/AFNO/AGRU models in test_deploy_zoo_mixers.py, tiny HF Llama/GPT-2/ViT in test_deploy_zoo_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_sweep import AOTI, BERT_ZOO, MIXER_ZOO, assert_deployed, zoo_graph

from fxforge.models.zoo import ZOO


def test_the_sweep_covers_the_whole_zoo() -> None:
    assert sorted(BERT_ZOO + MIXER_ZOO) == sorted(ZOO)


@pytest.mark.parametrize("fmt", ["onnx", AOTI])
@pytest.mark.parametrize("name", BERT_ZOO)
def test_bert_zoo_model_deploys_and_passes_the_subprocess_check(name: str, fmt: str, tmp_path: Path) -> None:
    assert_deployed(zoo_graph(name), fmt, tmp_path / f"{name}-{fmt}", name)
