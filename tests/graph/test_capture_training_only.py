"""Training-only behaviour (stochastic depth, LayerDrop, SpecAugment): switchable like eager, or captured in eval
semantics with train mode refused loudly -- never baked into the eval graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.graph.capture import capture
from fxforge.graph.training_guard import GUARD_MODULE, TrainingOnlyError, allow_training_in_eval_semantics
from fxforge.passes import dce_transform_pass

TINY_BEIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "image_size": 32, "patch_size": 8, "num_labels": 3}


def _beit(**overrides: float) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    return T.BeitForImageClassification(T.BeitConfig(**{**TINY_BEIT, **overrides})).eval()


def _wav2vec2() -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    config = T.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), vocab_size=20,
                              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    return T.Wav2Vec2ForCTC(config).eval()


def _guards(mg: ForgeGraph) -> list[torch.fx.Node]:
    return [n for n in mg.nodes if n.op == "call_module" and n.target == GUARD_MODULE]


def _random_nodes(mg: ForgeGraph) -> list[str]:
    return [n.name for n in mg.nodes if any(w in str(n.target) for w in ("rand", "bernoulli"))]


def _refuses(mg: ForgeGraph, call: object, *words: str) -> None:
    mg.train()
    with pytest.raises(TrainingOnlyError) as info:
        call()  # type: ignore[operator]
    for word in words:
        assert word in str(info.value)
    assert "allow_training_in_eval_semantics" in str(info.value)
    mg.eval()


def test_beit_drop_path_is_captured_in_eval_semantics_and_train_refuses(tmp_path: Path) -> None:
    model = _beit(drop_path_rate=0.1)
    mg = ForgeGraph(model, hf_input_names=["pixel_values"]).eval()
    assert not _random_nodes(mg) and len(_guards(mg)) == 1
    assert any("drop_path" in note and "BeitDropPath" in note for note in mg.capture_notes)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "beit"))
    cached = ForgeGraph(_beit(drop_path_rate=0.1), hf_input_names=["pixel_values"]).eval()
    for batch in (1, 3):
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            want = model(pixel_values=x).logits
            for graph in (mg, loaded, cached, mg.copy()):
                assert torch.equal(graph(pixel_values=x).logits, want)
    for graph in (mg, loaded, cached, mg.copy()):
        _refuses(graph, lambda g=graph, x=x: g(pixel_values=x), "beit.layers.1.drop_path", "drop_path_rate")
        with torch.no_grad():
            assert torch.equal(graph(pixel_values=x).logits, want)  # eval() runs again


def test_beit_without_drop_path_has_no_guard_and_dropout_switches_like_eager() -> None:
    model = _beit(drop_path_rate=0.0, hidden_dropout_prob=0.2)
    mg = ForgeGraph(model, hf_input_names=["pixel_values"])
    assert not _guards(mg) and not any("eval semantics" in note for note in mg.capture_notes)
    x = torch.randn(2, 3, 32, 32)
    mg.train()
    model.train()
    with torch.no_grad():
        torch.manual_seed(3)
        train_out = mg(pixel_values=x).logits
        torch.manual_seed(3)
        assert torch.equal(train_out, model(pixel_values=x).logits)
        mg.eval()
        assert not torch.equal(train_out, mg(pixel_values=x).logits)


class DropPath(nn.Module):
    """timm-style stochastic depth: drop whole samples in training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.drop_path = DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.drop(self.lin(x)))


class Net(nn.Module):
    def __init__(self, p: float = 0.5, noise: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(p), Block(p))
        self.head = nn.Linear(8, 2)
        self.noise = noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.blocks(x))
        return y + self.noise * torch.randn_like(y) if self.noise else y


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_drop_path_plain_torch(frontend: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    mg = ForgeGraph(model, torch.randn(3, 8), frontend=frontend).eval()  # type: ignore[arg-type]
    assert mg.frontend == frontend and not _random_nodes(mg) and len(_guards(mg)) == 1
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "net"))
    dce_transform_pass(mg)
    assert len(_guards(mg)) == 1
    for graph in (mg, loaded, mg.copy()):
        for batch in (3, 5):
            x = torch.randn(batch, 8)
            assert torch.equal(graph(x), model(x))
        _refuses(graph, lambda g=graph, x=x: g(x), "blocks.0.drop_path", "DropPath")
    # The documented opt-in: train in eval semantics (no stochastic depth), dropout still switchable.
    allow_training_in_eval_semantics(mg)
    mg.train()
    model.train()
    for block in model.blocks:
        block.drop_path.p = 0.0
    torch.manual_seed(1)
    out = mg(x)
    torch.manual_seed(1)
    assert torch.equal(out, model(x)) and not torch.equal(out, mg.eval()(x))


@pytest.mark.parametrize("training", [True, False])
def test_capture_restores_every_training_flag(training: bool) -> None:
    model = Net().train(training)
    result = capture(model, torch.randn(3, 8), frontend="export", cache=False)
    assert any("in eval semantics" in note for note in result.notes)
    assert all(m.training is training for m in model.modules())


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_random_op_that_is_eval_semantics_stays_without_guard(frontend: str) -> None:
    torch.manual_seed(0)
    model = Net(p=0.0, noise=0.1).eval()
    mg = ForgeGraph(model, torch.randn(3, 8), frontend=frontend).eval()  # type: ignore[arg-type]
    assert not _guards(mg) and len(_random_nodes(mg)) == 1
    x = torch.randn(4, 8)
    torch.manual_seed(2)
    out = mg(x)
    torch.manual_seed(2)
    assert torch.equal(out, model(x))


def test_wav2vec2_captures_with_its_untraceable_training_branches_in_eval_semantics(tmp_path: Path) -> None:
    model = _wav2vec2()
    mg = ForgeGraph(model, example_inputs={"input_values": torch.randn(2, 400)}).eval()
    notes = "\n".join(mg.capture_notes)
    assert "wav2vec2 (Wav2Vec2Model)" in notes and "IndexError" in notes and "_compute_mask_indices" in notes
    assert "wav2vec2.encoder (Wav2Vec2Encoder)" in notes and "data-dependent" in notes
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "w2v"))
    for length in (400, 333):
        x = torch.randn(2, length)
        with torch.no_grad():
            want = model(input_values=x).logits
            for graph in (mg, loaded):
                assert torch.equal(graph(input_values=x).logits, want)
    for graph in (mg, loaded):
        _refuses(graph, lambda g=graph, x=x: g(input_values=x), "wav2vec2.encoder", "layerdrop")
