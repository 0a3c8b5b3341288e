"""Analysis passes on real models: counting, graph report, trainable parameters."""

from __future__ import annotations

import torch
import torch.nn as nn
from conftest import make_gpt

from fxforge import ForgeGraph, passes


def test_count_dropouts_in_bert(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    _, info = passes.count_op_analysis_pass(mg)
    # embeddings + 2 per layer + classifier head; attention dropout lives in the SDPA module.
    assert info["counts"]["dropout"] == 6
    assert info["counts"]["linear"] == 2 * 6 + 2  # q k v o, intermediate, output per layer; pooler; classifier
    _, only = passes.count_op_analysis_pass(mg, {"ops": ["dropout", "conv2d"]})
    assert only["counts"] == {"conv2d": 0, "dropout": 6}


def test_report_graph_table(tiny_bert: nn.Module, tmp_path) -> None:
    mg = ForgeGraph(tiny_bert)
    _, plain = passes.report_graph_analysis_pass(mg, {"show": False})
    assert plain["rows"][0]["out_shapes"] == "-"  # no metadata yet
    passes.add_common_metadata_analysis_pass(mg)
    out = tmp_path / "report.v1.txt"
    _, info = passes.report_graph_analysis_pass(mg, {"show": False, "file": str(out)})
    header = info["table"].splitlines()[0].split()
    assert header == ["node", "kind", "op", "target", "in_shapes", "out_shapes", "out_dtype"]
    row = next(r for r in info["rows"] if r["target"] == "classifier")
    assert row["op"] == "linear" and row["out_shapes"] == "[2, 2]" and row["out_dtype"] == "float32"
    assert out.read_text().strip() == info["table"]
    assert len(info["rows"]) == len(list(mg.nodes))


def test_trainable_parameters_report_and_freezing(tiny_bert: nn.Module, capsys) -> None:
    mg = ForgeGraph(tiny_bert)
    _, info = passes.report_trainable_parameters_analysis_pass(mg)
    total = sum(p.numel() for p in tiny_bert.parameters())
    assert info["total"] == total and info["trainable"] == total and info["frozen"] == 0
    assert "trainable" in capsys.readouterr().out
    for p in mg.model.get_submodule("bert.embeddings").parameters():
        p.requires_grad = False
    _, frozen = passes.report_trainable_parameters_analysis_pass(mg.model, {"show": False})  # MASE style
    emb = sum(p.numel() for p in tiny_bert.bert.embeddings.parameters())
    assert frozen["frozen"] == emb and frozen["trainable"] == total - emb
    rows = {r["module"]: r for r in frozen["rows"]}
    assert rows["bert.embeddings.word_embeddings"]["frozen"] == 100 * 32


def test_gpt_counts_match_model() -> None:
    model = make_gpt("attn")
    mg = ForgeGraph(model, example_inputs=torch.randint(0, 64, (1, 4)))
    _, info = passes.count_op_analysis_pass(mg, {"ops": ("linear", "layer_norm")})
    assert info["counts"]["linear"] == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert info["counts"]["layer_norm"] == sum(isinstance(m, nn.LayerNorm) for m in model.modules())
