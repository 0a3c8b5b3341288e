"""Training-only behaviour (stochastic depth, LayerDrop, SpecAugment): switchable like eager, or captured in eval
semantics with train mode refused loudly -- never baked into the eval graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxforge import CaptureError, ForgeGraph
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
    def __init__(self, p: float = 0.5, noise: float = 0.0, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(p) for _ in range(depth)])
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


def test_many_drop_path_modules_are_each_taken_in_eval_semantics() -> None:
    """A deep model (BEiT-base has 12 DropPaths) is not pushed to the whole-model eval fallback."""
    torch.manual_seed(0)
    model = Net(depth=10).eval()
    mg = ForgeGraph(model, torch.randn(3, 8), frontend="fx").eval()
    guard = getattr(mg.model, GUARD_MODULE)
    assert guard.modules_in_eval == [f"blocks.{i}.drop_path" for i in range(10)]
    x = torch.randn(5, 8)
    assert torch.equal(mg(x), model(x))


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


def test_guard_survives_metadata_quantization_dead_code_and_checkpoints(tmp_path: Path) -> None:
    from pass_cases import FIXED_LINEAR

    from fxforge import passes

    torch.manual_seed(0)
    mg = ForgeGraph(Net().eval(), torch.randn(3, 8), frontend="export").eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    mg, _ = passes.quantize_transform_pass(mg, FIXED_LINEAR)
    mg.model.graph.eliminate_dead_code()  # fx's own: the guard has no users, but says it is impure
    mg.recompile()
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "q"))
    x = torch.randn(4, 8)
    for graph in (mg, loaded):
        assert len(_guards(graph)) == 1 and torch.equal(graph(x), mg(x))
        _refuses(graph, lambda g=graph: g(x), "blocks.1.drop_path")
    allow_training_in_eval_semantics(loaded)
    reloaded = ForgeGraph.from_checkpoint(loaded.export(tmp_path / "allowed"))
    reloaded.train()
    assert reloaded(x).shape == (4, 2)  # the opt-in is kept in the checkpoint


def test_no_random_op_no_extra_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import make_tiny_bert

    import fxforge.graph.capture as capture_module

    traces: list[str] = []
    real = capture_module._trace_normalized
    monkeypatch.setattr(capture_module, "_trace_normalized", lambda *a: traces.append(a[1]) or real(*a))
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"], cache=False)
    assert traces == ["export"] and not _guards(mg)


class _TrainOnlyBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.sum() > 0:  # untraceable only in train mode
            return x * 2
        return x


class _AlsoUntraceableInEval(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.branch = _TrainOnlyBranch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.branch(x)
        if x.mean() > 0:  # untraceable in any mode
            return x + 1
        return x


def test_error_names_what_still_fails_in_eval_mode_not_the_training_branch() -> None:
    with pytest.raises(CaptureError) as info:
        ForgeGraph(_AlsoUntraceableInEval(), frontend="fx")
    msg = str(info.value)
    assert "module '<root>' (_AlsoUntraceableInEval)" in msg and "if x.mean() > 0" in msg and "in eval mode" in msg
    assert "failed first in branch" in msg and "self.training and x.sum() > 0" in msg and "['branch'" in msg
    assert "leaf_modules" not in msg and "top-level forward" in msg


class _SizeBranch(nn.Module):
    """A training branch fx cannot trace (a size in an ``if``) but torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.size(0) > 1:
            x = self.drop(x)
        return self.lin(x)


def test_auto_prefers_a_frontend_that_traces_the_training_branch() -> None:
    mg = ForgeGraph(_SizeBranch(), torch.randn(3, 4))
    assert mg.frontend == "export" and not _guards(mg)
    assert not any("eval semantics" in note for note in mg.capture_notes)
