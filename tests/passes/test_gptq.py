"""gptq_transform_pass: GPTQ-rounded weights in the same quantized layers as round-to-nearest, with lower error."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxforge import ForgeGraph
from fxforge.passes import get_pass
from fxforge.passes.base import PassArgsError
from fxforge.passes.quantize.records import QuantizationRecord


def _mlp(d_in: int, hidden: int, d_out: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out)).eval()


def _batches(d_in: int, n: int = 4, rows: int = 64, seed: int = 1) -> list[tuple[torch.Tensor]]:
    """Correlated inputs (a random mixing matrix), as real activations are."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=gen)
    return [(torch.randn(rows, d_in, generator=gen) @ mix,) for _ in range(n)]


def _cfg(bits: int, fmt: str) -> dict:
    formats = {"fixed": {"name": "integer", "weight_width": bits, "weight_frac_width": "auto"},
               "scaled": {"name": "scaled_integer", "weight_width": bits, "weight_granularity": "per_channel"},
               "asym": {"name": "scaled_integer", "weight_width": bits, "weight_symmetric": False}}
    return {"by": "type", "linear": {"config": formats[fmt]}}


def _layers(g: ForgeGraph) -> dict[str, nn.Module]:
    return {p: m for p, m in g.model.named_modules() if hasattr(m, "weight_quantizer")}


@pytest.mark.parametrize(("shape", "fmt"), [((16, 32, 8), "fixed"), ((16, 32, 8), "asym"), ((24, 48, 12), "scaled")])
def test_gptq_lower_error_same_layers(shape: tuple[int, int, int], fmt: str) -> None:
    net = _mlp(*shape)
    data = _batches(shape[0])
    g = ForgeGraph(net, data[0])
    x = torch.cat([b[0] for b in data])
    for bits in (3, 4):
        gq, info = get_pass("gptq_transform_pass")(g, {"config": _cfg(bits, fmt), "data": data})
        gr, _ = get_pass("quantize_transform_pass")(g, _cfg(bits, fmt))
        assert info.batches == 4 and set(info.layers) == {"0", "2"} and not info.skipped
        q_layers, r_layers = _layers(gq), _layers(gr)
        assert list(q_layers) == list(r_layers)
        for path, layer in q_layers.items():
            ref = r_layers[path]
            assert type(layer) is type(ref)
            assert layer.weight_quantizer.to_config() == ref.weight_quantizer.to_config()
            w = layer.weight.detach()
            # the layer re-quantizes GPTQ's weight unchanged (up to float32 ulps of an affine scale re-derived
            # from the rounded range, as re-quantizing a round-to-nearest weight does)
            torch.testing.assert_close(layer.weight_quantizer(w), w, atol=1e-7, rtol=0)
            assert not torch.equal(w, ref.weight_quantizer(ref.weight.detach()))  # and it is not RTN's
            errs = info.layers[path]
            assert errs["gptq"] < errs["rtn"], (bits, path, errs)
        rec_q = {n.name: n.meta for n in gq.model.graph.nodes}
        for node in gr.model.graph.nodes:
            r = node.meta.get("fxforge")
            if r is not None and r.software.get(QuantizationRecord) is not None:
                assert rec_q[node.name]["fxforge"].software.get(QuantizationRecord) == \
                    r.software.get(QuantizationRecord)
        # the first layer's reconstruction error on the calibration inputs, measured directly
        w0 = net[0].weight.detach()
        q0 = q_layers["0"].weight.detach()
        r0 = r_layers["0"].weight_quantizer(r_layers["0"].weight.detach())
        assert (x @ (w0 - q0).T).pow(2).sum() < (x @ (w0 - r0).T).pow(2).sum()
    assert all(isinstance(p, torch.nn.Parameter) for p in net.parameters())  # the float model is untouched
    torch.testing.assert_close(net[0].weight, _mlp(*shape)[0].weight)


def test_gptq_lower_loss_on_trained_model() -> None:
    """A tiny MLP trained for a few steps on a teacher's labels: GPTQ at 3 bits loses less than RTN."""
    d_in = 16
    data = _batches(d_in, n=8, rows=64, seed=3)
    teacher = _mlp(d_in, 32, 4, seed=7)
    student = _mlp(d_in, 32, 4, seed=0).train()
    opt = torch.optim.Adam(student.parameters(), lr=2e-2)
    scale = data[0][0].std()
    for step in range(60):
        x = data[step % 6][0] / scale
        loss = F.cross_entropy(student(x), teacher(x).argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    student.eval()
    calib = [(b[0] / scale,) for b in data[:6]]
    held = torch.cat([b[0] / scale for b in data[6:]])
    labels = teacher(held).argmax(-1)
    g = ForgeGraph(student, calib[0])
    cfg = _cfg(3, "scaled")
    gq, _ = get_pass("gptq_transform_pass")(g, {"config": cfg, "data": calib})
    gr, _ = get_pass("quantize_transform_pass")(g, cfg)
    with torch.no_grad():
        loss_f, loss_q, loss_r = (F.cross_entropy(m(held), labels).item() for m in (g, gq, gr))
    assert loss_f < loss_q < loss_r, (loss_f, loss_q, loss_r)


def test_gptq_refuses_a_config_without_linear_weights() -> None:
    """Block formats are GPTQ-rounded (test_gptq_block); a config quantizing only the linears' inputs is refused."""
    net = _mlp(16, 32, 8)
    data = _batches(16)
    g = ForgeGraph(net, data[0])
    cfg = {"by": "type", "linear": {"config": {"name": "mxint", "data_in_width": 4}}}
    with pytest.raises(PassArgsError, match="quantizes no Linear weight"):
        get_pass("gptq_transform_pass")(g, {"config": cfg, "data": data})


def test_gptq_graph_packs_and_reloads_like_rtn(tmp_path) -> None:
    """The GPTQ graph checkpoints (weights packed in the layer's format) and reloads with the same outputs;
    act_order gives another rounding with the same guarantees."""
    net = _mlp(16, 32, 8)
    data = _batches(16)
    g = ForgeGraph(net, data[0])
    gq, info = get_pass("gptq_transform_pass")(g, {"config": _cfg(4, "scaled"), "data": data, "act_order": True})
    assert all(e["gptq"] < e["rtn"] for e in info.layers.values())
    loaded = ForgeGraph.from_checkpoint(gq.export(tmp_path / "gptq"))
    x = data[1][0]
    torch.testing.assert_close(loaded(x), gq(x))
    assert [type(m) for m in _layers(loaded).values()] == [type(m) for m in _layers(gq).values()]
