"""Tensor parallelism across 2 gloo processes on 127.0.0.1 (one spawn for the whole module, ~15 s of start-up per
launch): MiniLM, tiny Llama and the zoo GPT split by ``tensor_parallel`` give the single-process outputs within
1e-5, and each rank holds exactly its half of the split layers' weights."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from conftest import bert_inputs, make_gpt
from hf_tiny import hf_inputs, tiny_hf
from tp_worker import run_rank

from fxforge import ForgeGraph

WORLD = 2
MODELS = ("minilm", "llama", "gpt")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, minilm_classifier: torch.nn.Module) -> list[dict[str, Any]]:
    """Export the three graphs, record their single-process outputs, run the 2-rank job once; each rank's report."""
    root = tmp_path_factory.mktemp("tp")
    llama_in = hf_inputs("llama", 2, 9)
    llama_in.pop("labels")
    inputs = {"minilm": bert_inputs(vocab=1000, labels=False), "llama": llama_in,
              "gpt": {"idx": torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))}}
    graphs = {"minilm": ForgeGraph(minilm_classifier, hf_input_names=["input_ids", "attention_mask"]),
              "llama": ForgeGraph(tiny_hf("llama"), hf_input_names=["input_ids", "attention_mask"]),
              "gpt": ForgeGraph(make_gpt(), example_inputs=(torch.randint(0, 64, (2, 16)),))}
    reference = {}
    for name, mg in graphs.items():
        mg.eval().export(root / name)
        with torch.no_grad():
            reference[name] = _logits(mg(**inputs[name]))
    torch.save({"inputs": inputs, "reference": reference}, root / "io.pt")
    ctx = mp.start_processes(run_rank, args=(WORLD, _free_port(), str(root), list(MODELS)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the tensor-parallel job did not finish within 300 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("model", MODELS)
def test_outputs_equal_single_process(ranks: list[dict[str, Any]], model: str) -> None:
    for rank, report in enumerate(ranks):
        print(f"{model} rank {rank}: max |tensor parallel - single process| = {report[model]['max_abs_diff']:.2e}")
        assert report[model]["max_abs_diff"] <= 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_each_rank_holds_its_half_of_the_split_weights(ranks: list[dict[str, Any]], model: str) -> None:
    for report in ranks:
        r = report[model]
        assert r["shards_exact"]  # the local shard is exactly this rank's slice of the (reordered) weight
        assert r["sharded_local"] * WORLD == r["sharded_global"]
        assert r["params_local"] < r["params_global"] - r["sharded_global"] / WORLD + 1
        print(f"{model}: split layers {r['sharded_local']}/{r['sharded_global']} per rank, "
              f"all parameters {r['params_local']}/{r['params_global']} ({r['params_local'] / r['params_global']:.3f})")
    split = {"minilm": (6 * 4, 6 * 2), "llama": (2 * 5, 2 * 2), "gpt": (2 * 2, 2 * 2)}  # per layer: q/k/v (or a
    # fused q/k/v) and FFN up (and gate) column-wise, attention output and FFN down row-wise
    assert (len(ranks[0][model]["colwise"]), len(ranks[0][model]["rowwise"])) == split[model]
