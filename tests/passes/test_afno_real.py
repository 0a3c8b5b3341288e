"""afno_real_arithmetic_transform_pass: no complex arithmetic left in the graph; outputs and gradients unchanged
at two lengths and two model shapes; graphs without complex products unchanged; fused graphs reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import assert_reloads_and_exports, make_gpt

from fxforge import ForgeGraph, passes
from fxforge.passes.transform.afno_real import afno_real_arithmetic_transform_pass
from fxforge.passes.transform.fft_conv import fft_conv


def _meta(mg: ForgeGraph) -> ForgeGraph:
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _out_and_grads(mg: ForgeGraph, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mg.model.zero_grad(set_to_none=True)
    out = mg(x)
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in mg.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("shape", [{}, {"n_embd": 48, "afno_num_blocks": 3, "n_layer": 1}])
def test_afno_fft_convolutions_become_fft_conv(frontend: str, shape: dict[str, int]) -> None:
    idx = torch.randint(0, 64, (2, 16))
    base = _meta(ForgeGraph(make_gpt("afno", **shape), example_inputs=idx, frontend=frontend))
    layers = shape.get("n_layer", 2)
    real, info = afno_real_arithmetic_transform_pass(base.copy())
    assert info.rewritten == info.fft_convs == layers and info.complex_ops_before.count("mul") == layers
    assert info.complex_ops_before.count("fft_rfft") == 2 * layers
    assert info.complex_ops_after == ()  # the rffts now live inside fft_conv, which is real in and out
    assert sum(n.target is fft_conv for n in real.model.graph.nodes) == layers
    for seq in (16, 32):  # two sequence lengths (32 = the model's max_length)
        x = torch.randint(0, 64, (2, seq))
        (o1, g1), (o2, g2) = _out_and_grads(base, x), _out_and_grads(real, x)
        assert (o1 - o2).abs().max().item() <= 1e-5
        assert g1.keys() == g2.keys() and any("kernel" in name for name in g1)
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-5, msg=name)


class _SpectralProduct(nn.Module):
    """A complex product no irfft reads: it stays an elementwise multiply (in real arithmetic)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.fft.rfft(x, dim=1) * torch.fft.rfft(y, dim=1))


@pytest.mark.parametrize("length", [8, 11])
def test_other_complex_products_become_real_ops(length: int) -> None:
    x, y = torch.randn(2, length, 3, requires_grad=True), torch.randn(2, length, 3, requires_grad=True)
    base = _meta(ForgeGraph(_SpectralProduct(), example_inputs=(x, y), frontend="fx"))
    real, info = afno_real_arithmetic_transform_pass(base.copy())
    assert info.rewritten == 1 and info.fft_convs == 0 and set(info.complex_ops_after) == {"fft_rfft"}
    want, got = base(x, y), real(x, y)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    g_want = torch.autograd.grad(want.sum(), (x, y))
    g_got = torch.autograd.grad(got.sum(), (x, y))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_graph_without_complex_products_is_unchanged() -> None:
    idx = torch.randint(0, 64, (2, 8))
    mg = _meta(ForgeGraph(make_gpt("attn"), example_inputs=idx, frontend="fx"))
    code = mg.model.code
    mg, info = afno_real_arithmetic_transform_pass(mg)
    assert info.rewritten == 0 and mg.model.code == code


def test_rewritten_graph_reloads_and_exports(tmp_path: Path) -> None:
    idx = torch.randint(0, 64, (2, 16))
    mg, _ = afno_real_arithmetic_transform_pass(_meta(ForgeGraph(make_gpt("afno"), example_inputs=idx)))
    assert_reloads_and_exports(mg, idx, tmp_path / "afno_real", fft_conv, 2)
