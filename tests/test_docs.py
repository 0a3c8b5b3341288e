"""docs/shipping.md runs as written: its Python blocks execute in order (tiny BERT and Llama), its ``fxforge``
commands run through the console script, and every benchmark command it names exists with the flags it shows."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHIPPING = ROOT / "docs" / "shipping.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
BENCH = re.compile(r"python -m fxforge\.benchmarks\.(\w+)((?: \[[^\]`|]*(?:\\?\|[^\]`]*)?\])*)")


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed ``fxforge`` console script, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(Path(sys.executable).parent / "fxforge"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def blocks(path: Path, lang: str) -> list[str]:
    """The fenced code blocks of ``path`` in language ``lang`` ("" for unlabelled blocks), in order."""
    return [body for tag, body in FENCE.findall(path.read_text()) if tag == lang]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Run every Python block of docs/shipping.md in one namespace, inside a fresh directory."""
    cwd = tmp_path_factory.mktemp("shipping")
    ns: dict[str, Any] = {"__name__": "docs_shipping"}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        torch.manual_seed(0)
        for code in blocks(SHIPPING, "python"):
            exec(compile(code, str(SHIPPING), "exec"), ns)  # noqa: S102 - the documentation's own examples
    return ns, cwd


def test_python_blocks_do_what_the_text_says(shipped: tuple[dict[str, Any], Path]) -> None:
    ns, cwd = shipped
    info = ns["info"]  # the last pass info: the Llama's strict int4 lowering left nothing simulated
    assert info.skipped == {} and set(info.lowered.values()) == {"int4 g32"}
    lm, prompt = ns["lm"], ns["prompt"]
    assert torch.equal(ns["tokens"], lm.generate(prompt, max_new_tokens=20, do_sample=False))
    for name in ("bert-mxint4", "bert-int4", "bert-mxint4-qat", "llama-int4"):
        assert (cwd / "ckpt" / name / "manifest.json").is_file(), name
    packed = (cwd / "ckpt/bert-mxint4/weights.safetensors").stat().st_size
    float_weights = (cwd / "ckpt/bert-mxint4-qat/weights.safetensors").stat().st_size
    assert packed < float_weights / 4  # 4-bit codes + shared exponents against fp32 weights


def test_shell_commands_run(shipped: tuple[dict[str, Any], Path]) -> None:
    ns, cwd = shipped
    commands = [line for body in blocks(SHIPPING, "") for line in body.splitlines() if line.startswith("fxforge ")]
    assert commands, "docs/shipping.md shows no fxforge command"
    for line in commands:
        proc = run_cli(shlex.split(line)[1:], cwd)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        if line.startswith("fxforge generate"):
            want = ns["generate"](ns["low"], ns["prompt"], 20)
            assert proc.stdout.strip() == ",".join(str(t) for t in want[0].tolist())


@pytest.mark.parametrize("doc", [SHIPPING, ROOT / "README.md"], ids=lambda p: p.name)
def test_benchmark_commands_exist_with_their_flags(doc: Path) -> None:
    found = BENCH.findall(doc.read_text())
    for module, options in found:
        source = (ROOT / "benchmarks" / f"{module}.py").read_text()
        for flag in re.findall(r"--[a-z][a-z0-9-]*", options):
            assert f'"{flag}"' in source, f"{doc.name}: {module} has no {flag} option"
    if doc == SHIPPING:
        assert {m for m, _ in found} >= {"bench_decode_lowbit", "bench_woq_int8", "bench_woq_int4",
                                         "bench_minilm_lowered", "bench_pack"}


DEPLOY = ROOT / "docs" / "deploy.md"


@pytest.fixture(scope="module")
def deployed_docs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """Run every Python block of docs/deploy.md in one namespace, inside a fresh directory."""
    cwd = tmp_path_factory.mktemp("deploy-docs")
    ns: dict[str, Any] = {"__name__": "docs_deploy"}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        torch.manual_seed(0)
        for code in blocks(DEPLOY, "python"):
            exec(compile(code, str(DEPLOY), "exec"), ns)  # noqa: S102 - the documentation's own examples
    return ns, cwd


@pytest.mark.slow_deploy  # docs/deploy.md's blocks compile an AOTI package: make test-deploy
def test_deploy_python_blocks_do_what_the_text_says(deployed_docs: tuple[dict[str, Any], Path]) -> None:
    ns, cwd = deployed_docs
    mg, ids = ns["mg"], torch.as_tensor(ns["ids"])
    ids_t = ns["ids_t"]
    with torch.no_grad():  # the zoo graph takes labels too (for its loss); the deployed signature drops them
        want = mg.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(4, dtype=torch.long))
        want_aoti = mg.model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                             labels=torch.zeros(2, dtype=torch.long))
    assert ns["manifest"].passed and ns["aoti"].passed and ns["qdq"].passed
    assert torch.allclose(torch.as_tensor(ns["logits"]), want["logits"], rtol=1e-4, atol=1e-5)  # ORT, 4 x 20
    assert torch.allclose(ns["out"][0], want_aoti["logits"], rtol=1e-4, atol=1e-5)  # the AOTI package, 2 x 24
    assert ns["aoti"].inputs == ("input_ids", "attention_mask")
    assert ns["qdq"].quantization.startswith("qdq int8 (") and ns["qdq"].check.shapes[0].bound_kind == "quant_steps"
    assert "mxint(" in ns["refused"] and "bert.encoder.layer." in ns["refused"]
    assert not (cwd / "deploy" / "bert-mxint4-onnx").exists()  # refused before anything was written


@pytest.mark.slow_deploy
def test_deploy_shell_commands_run(deployed_docs: tuple[dict[str, Any], Path]) -> None:
    _, cwd = deployed_docs
    commands = [line for body in blocks(DEPLOY, "") for line in body.splitlines() if line.startswith("fxforge ")]
    assert [c.split()[1] for c in commands] == ["deploy", "inspect"]
    for line in commands:
        proc = run_cli(shlex.split(line)[1:], cwd)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        assert "check:        passed in a fresh subprocess: onnxruntime" in proc.stdout, proc.stdout
