"""benchmarks/runtime_workers: each runtime timed in its own process gives the same answers as in this one, and
a worker that cannot load its runtime says so instead of hanging the benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxforge import ForgeGraph
from fxforge.benchmarks import deploy_runtimes as rt
from fxforge.benchmarks.runtime_workers import RuntimeWorker, load_runner, save_inputs
from fxforge.models.bert import tiny_bert

# each worker is a fresh interpreter importing torch and fxforge (~5 s of CPU): CI's `make test-slow`, not `make test`
pytestmark = pytest.mark.slow_deploy


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("workers")
    torch.manual_seed(0)
    graph = ForgeGraph(tiny_bert(num_attention_heads=4), hf_input_names=["input_ids", "attention_mask", "labels"])
    graph.eval().export(root / "fp32")
    onnx_path, _ = rt.export_fp32_onnx(graph, root / "onnx")
    inputs = {"input_ids": torch.randint(0, 100, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    files = {"2x": str(save_inputs(inputs, root / "in.safetensors"))}
    return root / "fp32", onnx_path, files


def test_worker_runtimes_match_and_time(artifacts: tuple[Path, Path, dict[str, str]]) -> None:
    ckpt, onnx_path, files = artifacts
    specs = {"eager": {"kind": "eager", "path": str(ckpt)}, "ort": {"kind": "ort", "path": str(onnx_path)}}
    # what a worker runs is what the benchmark's in-process runners run: same logits from both runtimes
    from safetensors.torch import load_file

    inputs = load_file(files["2x"])
    with torch.no_grad():
        eager = load_runner({**specs["eager"], "threads": 1})(inputs)
        ort = load_runner({**specs["ort"], "threads": 1})(inputs)
    torch.testing.assert_close(torch.from_numpy(ort[0]), eager, rtol=1e-4, atol=1e-5)
    workers = [RuntimeWorker({**s, "threads": 1, "inputs": files}, settle_s=0.0) for s in specs.values()]
    try:
        times = [w.wait_ready().time("2x") for w in workers for _ in range(2)]
    finally:
        for w in workers:
            w.close()
    assert all(0 < t < 30 for t in times)
    assert all(w.proc.returncode == 0 for w in workers)


def test_worker_that_cannot_load_fails_loudly(tmp_path: Path) -> None:
    worker = RuntimeWorker({"kind": "ort", "path": str(tmp_path / "missing.onnx"), "threads": 1, "inputs": {}})
    try:
        with pytest.raises(RuntimeError, match="exited .* before answering 'ready'"):
            worker.wait_ready()
    finally:
        worker.close()
    with pytest.raises(ValueError, match="unknown kind"):
        load_runner({"kind": "tvm", "path": "x"})
