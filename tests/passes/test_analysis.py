"""Analysis passes on real models: counting, graph report, trainable parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt

from fxforge import ForgeGraph, passes


def _modules_run(model: nn.Module, kind: type[nn.Module]) -> int:
    """How many ``kind`` modules one train-mode eager forward calls (capture traces in train mode): what
    transformers' code runs, however it is written."""
    calls: list[str] = []
    hooks = [m.register_forward_hook(lambda *_, name=name: calls.append(name))
             for name, m in model.named_modules() if isinstance(m, kind)]
    was_training = model.training
    try:
        with torch.no_grad():
            model.train()(**bert_inputs())
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return len(calls)


def test_count_ops_in_bert_are_the_layers_that_run(tiny_bert: nn.Module) -> None:
    """One count per dropout / linear the model runs: a dropout module that only lends its p to SDPA is not a
    dropout op (its attention dropout lives in the SDPA module), so counts come from a forward, not the module tree."""
    dropouts, linears = _modules_run(tiny_bert, nn.Dropout), _modules_run(tiny_bert, nn.Linear)
    assert linears == sum(isinstance(m, nn.Linear) for m in tiny_bert.modules())  # every linear runs once
    mg = ForgeGraph(tiny_bert)
    _, info = passes.count_op_analysis_pass(mg)
    assert info["counts"]["dropout"] == dropouts > 0
    assert info["counts"]["linear"] == linears
    _, only = passes.count_op_analysis_pass(mg, {"ops": ["dropout", "conv2d"]})
    assert only["counts"] == {"conv2d": 0, "dropout": dropouts}


def test_count_op_names_are_validated(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    # nn.Module class names are aliases of their canonical op (MASE users write "Dropout")
    _, info = passes.count_op_analysis_pass(mg, {"ops": ["Dropout", "Linear", "dropout"]})
    _, canonical = passes.count_op_analysis_pass(mg, {"ops": ["dropout", "linear"]})
    assert info["counts"] == canonical["counts"] and canonical["counts"]["linear"] > 0
    for bad, close in (("Dropuot", "Dropout"), ("linearr", "linear"), ("no_such_op", "")):
        with pytest.raises(passes.PassArgsError, match=f"count_op_analysis_pass: unknown op name '{bad}'.*{close}"):
            passes.count_op_analysis_pass(mg, {"ops": [bad]})


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
