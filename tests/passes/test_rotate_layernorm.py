"""rotate_hadamard_transform_pass on pre-LN models (mode 'layernorm'): the zoo GPT's stream made mean-free,
its LayerNorms folded into the readers and replaced by unscaled RMSNorm, the stream rotated; outputs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import make_gpt

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes import get_pass
from fxforge.passes.base import PassError
from fxforge.passes.transform.hadamard import rotation_matrix

SHAPES = [(2, 8), (3, 17)]


def _gpt(bias: bool) -> nn.Module:
    """The tiny zoo GPT with trained-looking LayerNorms (random gamma, and beta when it has one)."""
    model = make_gpt(bias=bias)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("ln_f"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _common(mg: ForgeGraph) -> dict:
    return {n.name: get_meta(n).common.to_json() for n in mg.model.graph.nodes}


@pytest.mark.parametrize("bias", [pytest.param(False, marks=pytest.mark.slow), True])  # bias-free: the tests below
def test_pre_ln_gpt_rotated_keeps_outputs(bias: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randint(0, 64, shape, generator=gen) for shape in SHAPES]
    g = ForgeGraph(_gpt(bias), (inputs[0],))
    g, _ = passes.add_common_metadata_analysis_pass(g)
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g)  # auto finds the pre-LN stream
    assert info.mode == "layernorm" and info.rotation == "hadamard" and info.hidden == 32
    assert info.replaced_norms == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]
    assert set(info.rotated) == {"wte", "lm_head"} | {f"blocks.{i}.{m}" for i in (0, 1) for m in
                                                     ("mixer.c_attn", "mixer.c_proj", "mlp.c_fc", "mlp.c_proj")}
    with torch.no_grad():
        for idx in inputs:
            torch.testing.assert_close(rotated(idx), g(idx), atol=1e-5, rtol=1e-5)
    modules = dict(rotated.model.named_modules())
    assert not any(isinstance(m, nn.LayerNorm) for m in modules.values())
    assert all(type(modules[p]) is nn.RMSNorm and modules[p].weight is None for p in info.replaced_norms)
    assert (modules["blocks.0.mixer.c_attn"].bias is not None) == bias  # beta folded into a bias only if it has one
    assert not torch.allclose(modules["wte"].weight, dict(g.model.named_modules())["wte"].weight)
    again, _ = passes.add_common_metadata_analysis_pass(rotated.copy())
    assert _common(rotated) == _common(again)  # metadata as a fresh analysis computes it


def test_bias_free_linears_gain_the_folded_beta() -> None:
    """A LayerNorm with a shift feeding linears without bias: W·beta becomes their new bias."""
    model = make_gpt()
    with torch.no_grad():
        for block in model.blocks:
            block.ln1 = nn.LayerNorm(32)
            block.ln1.bias.normal_(0.0, 0.5)
    idx = torch.randint(0, 64, (2, 8))
    g = ForgeGraph(model.eval(), (idx,))
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g, {"mode": "layernorm"})
    assert rotated.model.get_submodule("blocks.0.mixer.c_attn").bias is not None
    assert rotated.model.get_submodule("blocks.0.mlp.c_fc").bias is None  # ln2 has no shift
    torch.testing.assert_close(rotated(idx), g(idx), atol=1e-5, rtol=1e-5)


def test_stream_is_mean_free_so_layer_norm_is_rms_norm() -> None:
    """Why replacing LayerNorm by RMSNorm is exact: un-rotated, every norm's input has zero mean along hidden, so
    LayerNorm's mean subtraction did nothing; rotated it does not (Q·1 is not 1), so LayerNorm could not stay."""
    idx = torch.randint(0, 64, (2, 8))
    g = ForgeGraph(_gpt(True), (idx,))
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g)
    q, _ = rotation_matrix(info.hidden)
    seen: list[torch.Tensor] = []
    hooks = [rotated.model.get_submodule(p).register_forward_hook(lambda m, a, o: seen.append(a[0].double()))
             for p in info.replaced_norms]
    with torch.no_grad():
        rotated(idx)
    for h in hooks:
        h.remove()
    assert len(seen) == len(info.replaced_norms)
    for x in seen:
        unrotated = x @ q.T
        assert unrotated.mean(-1).abs().max() < 1e-6 * unrotated.abs().max()
        assert x.mean(-1).abs().max() > 1e-3 * x.abs().max()
        xf = unrotated.float()
        torch.testing.assert_close(nn.functional.layer_norm(xf, (info.hidden,), eps=1e-5),
                                   nn.functional.rms_norm(xf, (info.hidden,), eps=1e-5), atol=1e-5, rtol=1e-5)


def test_rotated_gpt_reloads_from_checkpoint(tmp_path: Path) -> None:
    idx = torch.randint(0, 64, (2, 8))
    g = ForgeGraph(_gpt(False), (idx,))
    rotated, _ = get_pass("rotate_hadamard_transform_pass")(g, {"mode": "layernorm", "seed": 1})
    loaded = ForgeGraph.from_checkpoint(rotated.export(tmp_path / "rot"))
    assert type(loaded.model.get_submodule("ln_f")) is nn.RMSNorm
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), rotated(idx))


@pytest.mark.slow  # make test: test_rotation's LayerNorm net is left the same way, cheaper
def test_afno_gpt_is_not_a_pre_ln_stream() -> None:
    """AFNO's mixer reads the normed stream with no linear to fold into: auto leaves the graph saying so,
    mode='layernorm' refuses."""
    idx = torch.randint(0, 64, (2, 8))
    g = ForgeGraph(make_gpt("afno"), (idx,))
    out, info = get_pass("rotate_hadamard_transform_pass")(g)
    assert info.changed is False and info.mode == "" and "not an nn.Linear" in info.unsupported \
        and "mode='online'" in info.unsupported
    with torch.no_grad():
        assert torch.equal(out(idx), g(idx))
    with pytest.raises(PassError, match="mode='layernorm' does not fit this graph: .*'blocks.0.ln1' is read by"):
        get_pass("rotate_hadamard_transform_pass")(g, {"mode": "layernorm"})


def test_fused_then_online_down_projection() -> None:
    """QuaRot's recipe: the stream rotated in the weights, the MLP's wide input rotated online (targets)."""
    idx = torch.randint(0, 64, (2, 8))
    g = ForgeGraph(_gpt(False), (idx,))
    rotated, info = get_pass("rotate_hadamard_transform_pass")(
        g, {"mode": "layernorm", "targets": {"regex": r".*mlp\.c_proj"}})
    assert info.mode == "layernorm+online" and info.inserted == ["blocks.0.mlp.c_proj_hadamard",
                                                                  "blocks.1.mlp.c_proj_hadamard"]
    assert len(info.rotated) == 10 and len(info.replaced_norms) == 5
    with torch.no_grad():
        for shape in SHAPES:
            x = torch.randint(0, 64, shape)
            torch.testing.assert_close(rotated(x), g(x), atol=1e-5, rtol=1e-5)


class _CastingPreLN(nn.Module):
    """A pre-LN net whose writers reach the stream through eval dropout and casts, and no biases in the norms."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop = nn.Embedding(50, 24), nn.Dropout(0.1)
        self.ln1, self.fc = nn.LayerNorm(24), nn.Linear(24, 24)
        self.ln2, self.head = nn.LayerNorm(24, elementwise_affine=False), nn.Linear(24, 7)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(idx))
        x = x + self.fc(self.ln1(x)).to(torch.float32).contiguous()
        return self.head(self.ln2(x))


def test_writers_through_casts_and_eval_dropout() -> None:
    """Width 24 (Paley 12 x Sylvester 2); writers reach the stream through casts and eval dropout."""
    torch.manual_seed(0)
    net = _CastingPreLN().eval()
    with torch.no_grad():
        net.ln1.weight.uniform_(0.5, 1.5)
        net.ln1.bias.normal_(0.0, 0.3)
    idx = torch.randint(0, 50, (3, 5))
    g = ForgeGraph(net, (idx,))
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g, {"mode": "layernorm"})
    assert info.mode == "layernorm" and info.rotation == "hadamard" and info.replaced_norms == ["ln1", "ln2"]
    assert set(info.rotated) == {"emb", "fc", "head"}
    with torch.no_grad():
        for x in (idx, torch.randint(0, 50, (2, 9))):
            torch.testing.assert_close(rotated(x), g(x), atol=1e-5, rtol=1e-5)
