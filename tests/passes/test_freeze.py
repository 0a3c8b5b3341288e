"""The freeze helper takes the shared selectors; the trainable-parameter report reflects it and LoRA."""

from __future__ import annotations

import pytest
import torch.nn as nn
from conftest import make_gpt

from fxforge import ForgeGraph, passes
from fxforge.passes.select import select_modules


def test_freeze_embeddings_by_name_then_unfreeze(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    total = sum(p.numel() for p in tiny_bert.parameters())
    mg, info = passes.freeze_transform_pass(mg, {"targets": {"name": "embeddings"}})
    emb = sum(p.numel() for p in tiny_bert.bert.embeddings.parameters())  # tables and the LayerNorm
    assert info.modules == ["bert.embeddings"] and info.parameters == emb
    _, report = passes.report_trainable_parameters_analysis_pass(mg, {"show": False})
    assert report.frozen == emb and report.trainable == total - emb
    rows = {r["module"]: r for r in report["rows"]}
    assert rows["bert.embeddings.LayerNorm"]["trainable"] == 0 and rows["classifier"]["frozen"] == 0
    mg, info = passes.unfreeze_transform_pass(mg, {"targets": {"type": "embedding"}})
    assert len(info["modules"]) == 3 and not mg.model.get_submodule("bert.embeddings.LayerNorm").weight.requires_grad
    assert mg.model.get_submodule("bert.embeddings.word_embeddings").weight.requires_grad
    assert [r.name for r in mg.history] == ["freeze_transform_pass", "report_trainable_parameters_analysis_pass",
                                            "unfreeze_transform_pass"]


def test_freeze_by_regex_type_and_exclude() -> None:
    mg = ForgeGraph(make_gpt("attn"))
    mg, info = passes.freeze_transform_pass(mg, {"targets": {"regex": r"blocks\.0\..*", "type": "layer_norm"},
                                                "exclude": {"name": "ln_f"}})
    assert "blocks.0" not in info["modules"] and "blocks.0.mixer.c_attn" in info["modules"]
    assert "blocks.1.ln1" in info["modules"] and "ln_f" not in info["modules"]
    frozen = {n for n, p in mg.model.named_parameters() if not p.requires_grad}
    assert all(n.startswith("blocks.0.") or ".ln" in n for n in frozen) and "ln_f.weight" not in frozen
    assert [p for p, _ in select_modules(mg.model, {"name": "c_proj"})] == [
        "blocks.0.mixer.c_proj", "blocks.0.mlp.c_proj", "blocks.1.mixer.c_proj", "blocks.1.mlp.c_proj"]


def test_freeze_errors_name_the_problem(tiny_bert: nn.Module) -> None:
    mg = ForgeGraph(tiny_bert)
    with pytest.raises(passes.PassArgsError, match="'targets' is required"):
        passes.freeze_transform_pass(mg)
    with pytest.raises(passes.PassArgsError, match="allowed keys: \\['exclude', 'targets'\\]"):
        passes.freeze_transform_pass(mg, {"target": {"name": "embeddings"}})
    with pytest.raises(passes.PassError, match="no module with parameters matched.*bert.embeddings.word_embeddings"):
        passes.freeze_transform_pass(mg, {"targets": {"name": "embedding"}})
    assert all(p.requires_grad for p in mg.model.parameters())


def test_report_after_lora_lists_adapters(tiny_bert: nn.Module, capsys: pytest.CaptureFixture[str]) -> None:
    mg = ForgeGraph(tiny_bert)
    mg, lora = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "targets": {"name": ["query", "value"]},
                                                             "trainable": {"name": "classifier"}})
    _, report = passes.report_trainable_parameters_analysis_pass(mg)
    out = capsys.readouterr().out
    rows = {r["module"]: r for r in report["rows"]}
    q = rows["bert.encoder.layer.0.attention.self.query"]
    assert q["type"] == "LoraLinear" and q["trainable"] == 2 * (32 + 32) and q["frozen"] == 0
    assert rows["bert.encoder.layer.0.attention.self.query.base"]["frozen"] == 32 * 32 + 32
    assert rows["classifier"]["trainable"] == 32 * 2 + 2
    assert report["trainable"] == lora["trainable"] == 4 * 128 + 66 and "LoraLinear" in out
    assert f"trainable {report['trainable']:,} / total {report['total']:,}" in out
