"""``fxforge explore`` (issue 34 item 5): Model Explorer 0.1.34 loads the ExportedProgram of the pinned torch, and
fxforge's overlays reach it as node-data JSON keyed by the ids of the graph it serves."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import bert_metadata_graph

from fxforge import ForgeGraph, passes
from fxforge.report.explore import explorer_node_ids, prepare

QUANT = {"by": "name", "default": {"config": {"name": None}},
         "classifier": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                                   "weight_width": 4, "weight_frac_width": 2, "bias_width": 8, "bias_frac_width": 4}}}


def _values(path: Path) -> dict[str, float]:
    doc = json.loads(path.read_text())
    return {k: r["value"] for k, r in doc["graph"]["results"].items()}


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return bert_metadata_graph()


def test_overlays_are_node_data_of_the_graph_model_explorer_converts(bert: ForgeGraph, tmp_path: Path) -> None:
    """A tiny BERT with a pruned, 4-bit classifier: Model Explorer's own adapter converts the torch export, and
    each node-data file's keys are ids of that converted graph, with the classifier's real figures."""
    mg, _ = passes.prune_transform_pass(bert.copy(), {"weight": {"sparsity": 0.5},
                                                                "targets": {"name": "classifier"}})
    mg, _ = passes.quantize_transform_pass(mg, QUANT)
    config, files = prepare(mg, "tiny-bert", tmp_path)
    graph = config.graphs_list[0]["graphs"][0]  # what the server sends (load_graphs_json)
    served = {n.id for n in graph.nodes}
    assert {"params", "bits", "sparsity"} <= set(files.node_data)
    for path in files.node_data.values():
        assert set(_values(path)) <= served
    ids = explorer_node_ids(mg, files.program)
    classifier = ids["classifier"]
    assert _values(files.node_data["params"])[classifier] == 32 * 2 + 2
    assert _values(files.node_data["bits"])[classifier] == 4  # the real weight width, not the fp32 carrier's 32
    assert _values(files.node_data["sparsity"])[classifier] == 0.5
    dense = ids["bert_encoder_layer_0_intermediate_dense"]
    assert _values(files.node_data["bits"])[dense] == 32
    assert len(config.model_sources) == 1 and config.node_data_sources == [str(p) for p in files.node_data.values()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - a local test server
        return bytes(resp.read())


@pytest.mark.slow  # starts the Model Explorer server in a subprocess (~20 s with the checkpoint load and export)
def test_explore_serves_the_graph_and_its_node_data_headless(tmp_path: Path) -> None:
    """``fxforge explore CKPT --no-open --port P``: the server answers, serves the converted graph, and every
    node-data file it was given names nodes of that graph; stopped by its pid within a bounded time."""
    from cli.cli_support import fxforge_script, make_checkpoint

    from fxforge.cli.app import main

    ckpt = tmp_path / "quantized"
    make_checkpoint(ckpt)
    assert main(["explore", str(ckpt), "--no-serve", "--out", str(tmp_path / "files")]) == 0  # files only, no server
    assert (tmp_path / "files" / "fxforge_params.json").is_file()
    port, out = _free_port(), tmp_path / "node-data"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([str(fxforge_script()), "explore", str(ckpt), "--no-open", "--port", str(port),
                             "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    base = f"http://localhost:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "Model Explorer did not start in 240 s"
            try:
                if _get(f"{base}/check_health") == b"model_explorer_ok":
                    break
            except OSError:
                time.sleep(0.5)
        graphs = json.loads(_get(f"{base}/api/v1/load_graphs_json?graph_index=0"))
        served = {n["id"] for n in graphs["graphs"][0]["nodes"]}
        files = sorted(out.glob("fxforge_*.json"))
        assert {p.name for p in files} >= {"fxforge_params.json", "fxforge_bits.json"}
        for path in files:
            text = json.loads(_get(f"{base}/api/v1/read_text_file?path={urllib.parse.quote(str(path))}"))["content"]
            assert set(json.loads(text)["graph"]["results"]) <= served
        bits = set(_values(out / "fxforge_bits.json").values())
        assert 8 in bits and bits <= {8, 32, 64}  # quantized linears at 8 bits, the rest at their dtype's width
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def test_explore_reports_a_graph_it_cannot_export() -> None:
    """A graph without example inputs cannot be exported for Model Explorer: one error that says so."""
    import torch

    from fxforge.report.explore import ExplorerError, exported_program

    mg = ForgeGraph(torch.nn.Linear(2, 2), (torch.ones(1, 2),), frontend="fx")
    mg.example_inputs = None
    with pytest.raises(ExplorerError, match="no example inputs"):
        exported_program(mg)
