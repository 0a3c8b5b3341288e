"""afno_real_arithmetic_transform_pass: only the FFTs stay complex; outputs and gradients unchanged at two lengths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_gpt

from fxforge import ForgeGraph, passes
from fxforge.passes.transform.afno_real import afno_real_arithmetic_transform_pass


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_afno_complex_products_become_real(frontend: str) -> None:
    idx = torch.randint(0, 64, (2, 16))
    base = ForgeGraph(make_gpt("afno"), example_inputs=idx, frontend=frontend)
    base, _ = passes.init_metadata_analysis_pass(base)
    base, _ = passes.add_common_metadata_analysis_pass(base)
    real, info = afno_real_arithmetic_transform_pass(base.copy())
    assert info.rewritten == 2 and info.complex_ops_before.count("mul") == 2
    assert set(info.complex_ops_after) == {"fft_rfft"}  # the irffts return real tensors
    for seq in (16, 32):  # two sequence lengths (32 = the model's max_length)
        x = torch.randint(0, 64, (2, seq))
        grads = []
        for mg in (base, real):
            mg.model.zero_grad(set_to_none=True)
            out = mg(x)
            out.pow(2).mean().backward()
            grads.append((out.detach(), {n: p.grad.clone() for n, p in mg.model.named_parameters()}))
        (o1, g1), (o2, g2) = grads
        assert (o1 - o2).abs().max().item() <= 1e-5
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-5, msg=name)


def test_graph_without_complex_products_is_unchanged() -> None:
    idx = torch.randint(0, 64, (2, 8))
    mg = ForgeGraph(make_gpt("attn"), example_inputs=idx, frontend="fx")
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    code = mg.model.code
    mg, info = afno_real_arithmetic_transform_pass(mg)
    assert info.rewritten == 0 and mg.model.code == code
