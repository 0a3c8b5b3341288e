"""rotate_hadamard_transform_pass: RMSNorm scales folded and the residual stream rotated, outputs unchanged."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import hf_inputs, tiny_hf

from fxforge import ForgeGraph
from fxforge.passes import get_pass
from fxforge.passes.transform.rotate_hadamard import hadamard


def _logits(out: object) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out  # type: ignore[index,return-value]


@pytest.mark.parametrize(("family", "overrides", "kind"), [
    ("llama", {"tie_word_embeddings": True}, "hadamard"),
    # a second capture of an HF decoder costs ~4 s: the second shape (and family) runs in make test-slow
    pytest.param("qwen2", {"hidden_size": 48, "intermediate_size": 80}, "hadamard", marks=pytest.mark.slow),  # 12·4
    pytest.param("qwen2", {"hidden_size": 36, "num_attention_heads": 2, "intermediate_size": 80}, "random_orthogonal",
                 marks=pytest.mark.slow),  # 36: no Hadamard order
])
def test_rotation_keeps_outputs(family: str, overrides: dict, kind: str) -> None:
    model = tiny_hf(family, **overrides)
    with torch.no_grad():  # trained-looking norm scales (HF initialises them to 1), so folding them matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    g = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"])
    inputs = {k: v for k, v in hf_inputs(family, 2, 9).items() if k != "labels"}
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g)
    assert info.mode == "rmsnorm" and info.rotation == kind and info.blocks == 2 and len(info.folded_norms) == 5
    assert info.untied == overrides.get("tie_word_embeddings", False)
    torch.testing.assert_close(_logits(rotated(**inputs)), _logits(g(**inputs)), atol=1e-5, rtol=1e-5)
    params = dict(rotated.model.named_parameters())
    norms = [p for n, p in params.items() if n.endswith("norm.weight")]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)  # scales folded away
    before = dict(g.model.named_parameters())
    name = next(n for n in params if n.endswith("embed_tokens.weight"))
    assert not torch.allclose(params[name], before[name])  # the stream really is rotated


def test_hadamard_is_orthogonal() -> None:
    h = hadamard(16)
    torch.testing.assert_close(h @ h.T, torch.eye(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="powers of two"):
        hadamard(12)


def test_rotation_leaves_layer_norm_models_saying_why() -> None:
    x = torch.randn(2, 8)
    g = ForgeGraph(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), (x,))
    out, info = get_pass("rotate_hadamard_transform_pass")(g)
    assert "'1' is a LayerNorm, not an RMSNorm" in info.unsupported
    assert "LayerNorm '1' is read by 'output'" in info.unsupported  # not a pre-LN stream either
    assert info.mode == "" and info.blocks == 0 and info.changed is False
    assert torch.equal(out(x), g(x))
