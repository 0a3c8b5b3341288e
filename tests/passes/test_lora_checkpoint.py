"""Adapter-only LoRA checkpoints: applied to a freshly captured base, strict, tamper-evident, pickle-free."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes.lora_checkpoint import (
    CONFIG,
    MANIFEST,
    WEIGHTS,
    LoraCheckpointError,
    load_lora_adapters,
    save_lora_adapters,
)
from fxforge.passes.transform.lora import LoraLinear, lora_layers

HF_NAMES = ["input_ids", "attention_mask", "labels"]


@pytest.fixture(scope="module")
def base_graph() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()


def _trained(base: ForgeGraph) -> ForgeGraph:
    """Adapters on query/value (rank 4) and on every dense (rank 2, other alpha), classifier fully trained."""
    mg = base.copy()
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": {
        "name": ["query", "value"]}, "trainable": {"name": "classifier"}})
    mg, _ = passes.insert_lora_adapter_transform_pass(mg, {"rank": 2, "alpha": 1.0, "freeze_rest": False,
                                                   "targets": {"regex": r".*\.(intermediate|output)\.dense"}})
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in mg.model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return mg


def _rewrite(path: Path, config: dict | None = None, weights: dict | None = None) -> None:
    """Change a checkpoint's content *and* its manifest (a well-formed but different checkpoint)."""
    files = {}
    if config is not None:
        (path / CONFIG).write_text(json.dumps(config))
    if weights is not None:
        (path / WEIGHTS).write_bytes(safetensors.torch.save(weights))
    for name in (CONFIG, WEIGHTS):
        data = (path / name).read_bytes()
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = files
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_adapter_checkpoint_round_trip(base_graph: ForgeGraph, tmp_path: Path) -> None:
    mg = _trained(base_graph)
    inputs = bert_inputs()
    with torch.no_grad():
        expected = mg(**inputs).logits
    path = save_lora_adapters(mg, tmp_path / "adapter")
    assert sorted(f.name for f in path.iterdir()) == sorted([CONFIG, WEIGHTS, MANIFEST])
    stored = safetensors.torch.load_file(str(path / WEIGHTS))
    assert set(stored) == {f"{p}.lora_{x}" for _, p, _ in lora_layers(mg.model) for x in "AB"} | {
        "classifier.weight", "classifier.bias"}
    fresh = ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES).eval()
    with torch.no_grad():
        assert (fresh(**inputs).logits - expected).abs().max() > 1e-3
    fresh, info = load_lora_adapters(fresh, path)
    assert len(info["adapted"]) == 10 and info["modules_to_save"] == ["classifier"]
    assert info["extras"] == ["classifier.weight", "classifier.bias"]
    with torch.no_grad():
        assert (fresh(**inputs).logits - expected).abs().max() <= 1e-6
    ranks = {p: m.rank for _, p, m in lora_layers(fresh.model)}
    assert ranks["bert.encoder.layer.0.attention.self.query"] == 4 and ranks["bert.encoder.layer.1.output.dense"] == 2
    assert not any(isinstance(m, LoraLinear) and m.training for m in fresh.model.modules())
    trainable = {n for n, p in fresh.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in mg.model.named_parameters() if p.requires_grad}
    fresh, _ = passes.fuse_lora_weights_transform_pass(fresh)
    with torch.no_grad():
        assert (fresh(**inputs).logits - expected).abs().max() <= 1e-5


def test_tampered_or_mismatched_checkpoints_are_refused(base_graph: ForgeGraph, tmp_path: Path) -> None:
    mg = _trained(base_graph)
    path = save_lora_adapters(mg, tmp_path / "a")
    fresh = base_graph.copy()

    raw = bytearray((path / WEIGHTS).read_bytes())
    raw[-1] ^= 1
    (path / WEIGHTS).write_bytes(bytes(raw))
    with pytest.raises(LoraCheckpointError, match="SHA-256 does not match"):
        fresh, _ = load_lora_adapters(fresh, path)
    save_lora_adapters(mg, path)

    weights = safetensors.torch.load_file(str(path / WEIGHTS))
    _rewrite(path, weights={**weights, "bert.encoder.layer.0.attention.self.key.lora_A": torch.zeros(4, 32)})
    with pytest.raises(LoraCheckpointError, match=r"unexpected \['bert.encoder.layer.0.attention.self.key"):
        fresh, _ = load_lora_adapters(fresh, path)
    _rewrite(path, weights={k: v for k, v in weights.items() if k != "classifier.bias"})
    with pytest.raises(LoraCheckpointError, match=r"missing \['classifier.bias'\]"):
        fresh, _ = load_lora_adapters(fresh, path)
    _rewrite(path, weights={**weights, "bert.encoder.layer.0.attention.self.query.lora_A": torch.zeros(3, 32)})
    with pytest.raises(LoraCheckpointError, match=r"lora_A' is \(3, 32\).*expects \(4, 32\)"):
        fresh, _ = load_lora_adapters(fresh, path)

    save_lora_adapters(mg, path)
    config = json.loads((path / CONFIG).read_text())
    config["layers"][0]["name"] = "bert.encoder.layer.0.attention.self.querry"
    _rewrite(path, config=config)
    with pytest.raises(LoraCheckpointError, match="querry: no nn.Linear layer of that name"):
        fresh, _ = load_lora_adapters(fresh, path)
    assert not lora_layers(fresh.model)  # every check runs before the graph is touched

    save_lora_adapters(mg, path)
    other = ForgeGraph(make_tiny_bert(), hf_input_names=HF_NAMES)
    with torch.no_grad():
        other.model.get_submodule("bert.encoder.layer.1.attention.self.value").weight.mul_(2)
    with pytest.raises(LoraCheckpointError, match="layer.1.attention.self.value: base weights differ"):
        other, _ = load_lora_adapters(other, path)
    other, _ = load_lora_adapters(other, path, check_base=False)
    with pytest.raises(LoraCheckpointError, match="already has a LoRA adapter"):
        other, _ = load_lora_adapters(other, path)
    with pytest.raises(LoraCheckpointError, match="no LoRA adapters to save"):
        save_lora_adapters(base_graph, tmp_path / "empty")
    with pytest.raises(LoraCheckpointError, match="nowhere: no such checkpoint directory"):
        fresh, _ = load_lora_adapters(fresh, tmp_path / "nowhere")


def test_adapted_graph_survives_export_and_reload(base_graph: ForgeGraph, tmp_path: Path) -> None:
    from fxforge.graph.metadata import get_meta
    from fxforge.passes.transform.lora import LoraRecord

    mg = base_graph.copy()
    passes.init_metadata_analysis_pass(mg)
    passes.add_common_metadata_analysis_pass(mg)
    mg = _trained(mg)
    inputs = bert_inputs()
    with torch.no_grad():
        expected = mg(**inputs)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "graph"))
    with torch.no_grad():
        again = loaded(**inputs)
    assert torch.equal(again.logits, expected.logits) and torch.equal(again.loss, expected.loss)
    before = {p: (m.rank, m.alpha, m.dropout_p, m.training) for _, p, m in lora_layers(mg.model)}
    assert {p: (m.rank, m.alpha, m.dropout_p, m.training) for _, p, m in lora_layers(loaded.model)} == before
    record = get_meta(loaded.node("bert_encoder_layer_0_attention_self_query")).software.get(LoraRecord)
    assert record is not None and record.rank == 4 and record.alpha == 8.0
    flags = {n: p.requires_grad for n, p in mg.model.named_parameters()}
    assert {n: p.requires_grad for n, p in loaded.model.named_parameters()} == flags
    loaded.train()
    loaded(**inputs).loss.backward()
    grads = {n for n, p in loaded.model.named_parameters() if p.grad is not None}
    assert grads == {n for n, f in flags.items() if f} and any("lora_B" in n for n in grads)
    loaded.eval()
    loaded, _ = passes.fuse_lora_weights_transform_pass(loaded)
    with torch.no_grad():
        assert (loaded(**inputs).logits - expected.logits).abs().max() <= 1e-5


def test_an_adapted_layers_trained_bias_is_refused_not_dropped(base_graph: ForgeGraph, tmp_path: Path) -> None:
    """LoRA + BitFit on an adapted layer: its bias is the frozen base the fingerprint covers, so an adapter
    checkpoint cannot carry it; save says so (instead of writing an adapter that replaces base weights)."""
    mg = _trained(base_graph)
    mg.model.get_submodule("bert.encoder.layer.0.attention.self.query").base.bias.requires_grad_(True)
    with pytest.raises(LoraCheckpointError, match=r"query.base.bias'\] are trainable but neither"):
        save_lora_adapters(mg, tmp_path / "a")
    path = save_lora_adapters(mg, tmp_path / "a", include_trainable=False)  # the adapters alone
    assert set(safetensors.torch.load_file(str(path / WEIGHTS))) == {
        f"{p}.lora_{x}" for _, p, _ in lora_layers(mg.model) for x in "AB"}
