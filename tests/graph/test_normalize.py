"""Normalisation lifts an ATen call into a call_module only when the module's forward is exactly that op."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fxforge import ForgeGraph


def _call_modules(mg: ForgeGraph) -> set[str]:
    return {str(n.target) for n in mg.nodes if n.op == "call_module"}


def test_opt_learned_positional_embedding_is_not_lifted() -> None:
    # OPTLearnedPositionalEmbedding is an nn.Embedding subclass whose forward adds an offset to the positions.
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False)
    model = OPTForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mg = ForgeGraph(model, {"input_ids": ids, "attention_mask": mask}).eval()
    path = "model.decoder.embed_positions"
    assert path not in _call_modules(mg) and "model.decoder.embed_tokens" in _call_modules(mg)
    assert any(path in note and "overrides forward" in note for note in mg.capture_notes)
    with torch.no_grad():
        for length in (10, 7):
            inputs = {"input_ids": ids[:, :length], "attention_mask": mask[:, :length]}
            assert (mg(**inputs).logits - model(**inputs).logits).abs().max() <= 1e-5


class ScaledLinear(nn.Linear):
    """A user subclass whose forward is not F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 2.0) + 1.0


class PlainSubclass(nn.Linear):
    """A subclass that does not override forward: still exactly aten.linear."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaled = ScaledLinear(8, 8)
        self.plain = PlainSubclass(8, 8)
        self.hooked = nn.Linear(8, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hooked(self.act(self.plain(self.scaled(x))))


def test_subclass_with_own_forward_and_hooked_modules_stay_aten_calls() -> None:
    torch.manual_seed(0)
    net = Net().eval()

    def triple(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out * 3.0

    net.hooked.register_forward_hook(triple)
    x = torch.randn(3, 8)
    mg = ForgeGraph(net, x, frontend="export").eval()
    lifted = _call_modules(mg)
    assert "plain" in lifted and "act" in lifted
    assert "scaled" not in lifted and "hooked" not in lifted
    notes = " | ".join(mg.capture_notes)
    assert "'scaled' (ScaledLinear) overrides forward" in notes and "'hooked' (Linear) has forward hooks" in notes
    with torch.no_grad():
        for batch in (3, 5):
            xb = torch.randn(batch, 8)
            assert (mg(xb) - net(xb)).abs().max() <= 1e-6
