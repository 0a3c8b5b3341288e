"""``fxforge generate CKPT --prompt-ids ... --max-new-tokens N`` in a subprocess: HF generate's greedy tokens from
a reloaded static-cache checkpoint of tiny Llama and GPT-2, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_support import run_cli
from hf_tiny import tiny_hf

from fxforge.graph.static_cache import capture_static_cache


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for family in ("llama", "gpt2"):
        lm = tiny_hf(family)
        out[family] = (lm, capture_static_cache(lm, 40).export(tmp_path_factory.mktemp(family) / "ckpt"))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_prints_hf_greedy_tokens(checkpoints: dict[str, tuple[torch.nn.Module, Path]], family: str) -> None:
    lm, path = checkpoints[family]
    prompt = [5, 17, 42, 8]
    proc = run_cli("generate", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "30",
                   "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    want = lm.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert proc.stdout.strip() == ",".join(str(t) for t in want[0].tolist())
    assert len(proc.stdout.strip().split(",")) == len(prompt) + 30


def test_generate_stops_at_the_eos_given(checkpoints: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    lm, path = checkpoints["gpt2"]
    free = lm.generate(torch.tensor([[3, 9]]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0].tolist()
    eos = free[4]  # the third new token
    proc = run_cli("generate", str(path), "--prompt-ids", "3,9", "--max-new-tokens", "8", "--eos-token-ids", str(eos))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ",".join(map(str, free[:free.index(eos, 2) + 1]))


@pytest.mark.parametrize("args,fragment", [
    (["--prompt-ids", "1,x", "--max-new-tokens", "3"], "'x' is not a token id"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "50"], "larger max_cache_len"),
])
def test_bad_requests_are_one_line_errors(checkpoints: dict[str, tuple[torch.nn.Module, Path]], args: list[str],
                                          fragment: str) -> None:
    proc = run_cli("generate", str(checkpoints["gpt2"][1]), *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and fragment in lines[0], proc.stderr

