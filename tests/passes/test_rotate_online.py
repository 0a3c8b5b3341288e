"""rotate_hadamard_transform_pass mode 'online': selected linears get W·H and x·H on their input, any model
(post-LN BERT included); outputs unchanged, and outlier weight columns spread so 4-bit rounding loses less."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.passes import PassArgsError, get_pass
from fxforge.passes.base import PassError
from fxforge.passes.transform.hadamard import HadamardRotation, hadamard_factors, hadamard_matrix, paley

SHAPES = [(3, 11), (2, 7)]


@pytest.fixture(scope="module")
def bert() -> ForgeGraph:
    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])


@pytest.fixture(scope="module")
def mlp() -> ForgeGraph:
    x = torch.randn(4, 64)
    return ForgeGraph(_outlier_mlp(), (x,))


def _logits(g: ForgeGraph) -> list[torch.Tensor]:
    with torch.no_grad():
        return [g(**bert_inputs(labels=False, batch=b, seq=s)).logits for b, s in SHAPES]


# the tiny BERT's capture costs ~3 s: make test checks mode online on BERT at two shapes through
# test_transform_contracts (outputs and metadata); sharing, selectors and checkpoints on BERT run in make test-slow
@pytest.mark.slow
def test_online_rotation_of_post_ln_bert_keeps_outputs(bert: ForgeGraph, tmp_path: Path) -> None:
    rotated, info = get_pass("rotate_hadamard_transform_pass")(bert, {"mode": "online"})
    assert info.mode == "online" and not info.skipped
    linears = [p for p, m in bert.model.named_modules() if type(m) is nn.Linear]
    assert info.rotated == linears
    # query / key / value read one value: one rotation serves the three
    assert "bert.encoder.layer.0.attention.self.query_hadamard" in info.inserted
    assert not any("key_hadamard" in p or "value_hadamard" in p for p in info.inserted)
    assert len(info.inserted) == len(linears) - 2 * 2  # two layers, key and value share query's
    for ref, out in zip(_logits(bert), _logits(rotated)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w0 = bert.model.get_submodule("classifier").weight
    assert not torch.allclose(rotated.model.get_submodule("classifier").weight, w0)
    loaded = ForgeGraph.from_checkpoint(rotated.export(tmp_path / "online"))  # HadamardRotation rebuilt
    assert type(loaded.model.get_submodule(info.inserted[0])) is HadamardRotation
    for ref, out in zip(_logits(rotated), _logits(loaded)):
        torch.testing.assert_close(out, ref)


@pytest.mark.slow
def test_online_rotation_follows_the_selector(bert: ForgeGraph) -> None:
    rotated, info = get_pass("rotate_hadamard_transform_pass")(
        bert, {"targets": {"regex": r".*intermediate\.dense"}, "exclude": {"regex": r".*layer\.1\..*"}})
    assert info.mode == "online"  # targets given: auto means online
    assert info.rotated == ["bert.encoder.layer.0.intermediate.dense"]
    for ref, out in zip(_logits(bert), _logits(rotated)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_online_rotation_of_the_zoo_gpt_reloads(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randint(0, 64, shape, generator=gen) for shape in ((2, 8), (3, 13))]
    g = ForgeGraph(make_gpt(), (inputs[0],))
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g, {"mode": "online", "exclude": {"name": "lm_head"}})
    assert info.mode == "online" and len(info.rotated) == 8 and "lm_head" not in info.rotated
    assert len(info.inserted) == 8 and not info.skipped
    loaded = ForgeGraph.from_checkpoint(rotated.export(tmp_path / "online"))  # HadamardRotation rebuilt
    assert type(loaded.model.get_submodule(info.inserted[0])) is HadamardRotation
    with torch.no_grad():
        for idx in inputs:
            torch.testing.assert_close(rotated(idx), g(idx), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(loaded(idx), rotated(idx))


def test_rotation_args_are_refused_with_the_reason(mlp: ForgeGraph) -> None:
    rotate = get_pass("rotate_hadamard_transform_pass")
    with pytest.raises(PassArgsError, match="mode must be one of"):
        rotate(mlp, {"mode": "quarot"})
    with pytest.raises(PassArgsError, match="allowed"):
        rotate(mlp, {"modes": "online"})
    with pytest.raises(PassError, match="mode='layernorm' does not fit this graph: layernorm: no LayerNorm"):
        rotate(mlp, {"mode": "layernorm", "targets": {"type": "linear"}})
    with pytest.raises(PassError, match="online rotation selected no nn.Linear"):
        rotate(mlp, {"targets": {"type": "relu"}})
    adapted, _ = get_pass("insert_lora_adapter_transform_pass")(mlp, {"rank": 2})
    with pytest.raises(PassError, match="insert_lora_adapter_transform_pass"):  # rotate before adding LoRA
        rotate(adapted, {"mode": "online"})


def _outlier_mlp(seed: int = 0) -> nn.Module:
    """Two linears whose weights have a few input columns 30x the rest (the channels LLM weights have)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 16)).eval()
    with torch.no_grad():
        for lin in (net[0], net[2]):
            cols = torch.randperm(lin.in_features)[:3]
            lin.weight[:, cols] *= 30.0
    return net


def test_rotation_lowers_4bit_round_to_nearest_error(mlp: ForgeGraph) -> None:
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    g = mlp
    rotated, info = get_pass("rotate_hadamard_transform_pass")(g, {"mode": "online"})
    assert info.rotated == ["0", "2"]
    cfg = {"by": "type", "linear": {"config": {"name": "scaled_integer", "weight_width": 4,
                                               "weight_granularity": "per_channel"}}}
    quantize = get_pass("quantize_transform_pass")
    with torch.no_grad():
        ref = g(x)
        torch.testing.assert_close(rotated(x), ref, atol=1e-4, rtol=1e-5)
        plain_err = (quantize(g, cfg)[0](x) - ref).pow(2).mean()
        rotated_err = (quantize(rotated, cfg)[0](x) - ref).pow(2).mean()
    assert rotated_err < 0.5 * plain_err, (rotated_err, plain_err)


@pytest.mark.parametrize(("n", "factors"), [(32, (1, 1, 32)), (12, (1, 12, 1)), (384, (1, 12, 32)),
                                            (24, (1, 12, 2)), (30, (15, 1, 2))])
def test_hadamard_widths(n: int, factors: tuple[int, int, int]) -> None:
    """Sylvester x Paley orders cover BERT's widths; others get a block-diagonal Hadamard; x·H at run time."""
    assert hadamard_factors(n) == factors
    h, block = hadamard_matrix(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    assert block == factors[1] * factors[2]
    x = torch.randn(2, 3, n)
    torch.testing.assert_close(HadamardRotation(n)(x), (x.double() @ h).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prime and 3 mod 4"):
        paley(16)
