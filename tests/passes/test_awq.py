"""awq_transform_pass: input scaling exact before quantization, output error at most round-to-nearest's after.

The tiny BERT's exactness is checked in test_transform_contracts, on the BERT graph that file captures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import make_gpt

from fxforge import ForgeGraph
from fxforge.passes import get_pass
from fxforge.passes.base import PassArgsError
from fxforge.passes.quantize import ChannelScale
from fxforge.passes.quantize.state import quantizers

INT4 = {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 4, "weight_frac_width": "auto"}}}
MXINT4 = {"by": "type", "linear": {"config": {"name": "mxint", "weight_width": 4, "weight_block_size": 8}}}
awq = get_pass("awq_transform_pass")


def _float_view(mg: ForgeGraph) -> ForgeGraph:
    """The graph with every quantizer off: what the scaled float weights compute."""
    for q in quantizers(mg.model).values():
        q.enabled = False
    return mg


def _scale_nodes(mg: ForgeGraph) -> int:
    return sum(isinstance(m, ChannelScale) for m in mg.model.modules())


def _assert_same(ref: torch.Tensor, out: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_scaling_alone_keeps_gpt_outputs_at_two_shapes() -> None:
    """The zoo GPT: c_attn / c_fc scales folded into ln1 / ln2, the c_proj ones in ChannelScale nodes."""
    gen = torch.Generator().manual_seed(2)
    calib = [(torch.randint(0, 64, (2, 16), generator=gen),) for _ in range(3)]
    model = make_gpt()
    with torch.no_grad():  # outlier channels in what the linears read, as trained LLMs have
        for block in model.blocks:
            block.ln1.weight[:3] *= 20.0
            block.ln2.weight[:3] *= 20.0
    mg = ForgeGraph(model, example_inputs=calib[0])
    out, info = awq(mg, {"config": INT4, "data": calib})
    assert info.batches == 3 and not info.skipped and len(info.layers) == 9
    for b in (0, 1):
        assert info.scaled_into[f"blocks.{b}.mixer.c_attn"] == f"blocks.{b}.ln1 (LayerNorm)"
        assert info.scaled_into[f"blocks.{b}.mlp.c_fc"] == f"blocks.{b}.ln2 (LayerNorm)"
    assert _scale_nodes(out) == sum(w.endswith("(ChannelScale)") for w in set(info.scaled_into.values())) >= 1
    for entry in info.layers.values():
        assert 0.0 <= entry["alpha"] <= 1.0 and entry["awq"] <= entry["rtn"]
    assert any(e["alpha"] > 0 and e["awq"] < e["rtn"] for e in info.layers.values())
    _float_view(out)
    with torch.no_grad():
        for shape in ((2, 16), (3, 24)):
            idx = torch.randint(0, 64, shape, generator=gen)
            _assert_same(mg(idx), out(idx))


class _GatedBlock(nn.Module):
    """An RMSNorm as a per-channel parameter product, then a gated MLP (act(gate) * up -> down)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.rand(16) + 0.5)
        self.gate, self.up, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _outlier_batches(d_in: int, n: int = 4, rows: int = 64, seed: int = 1) -> list[tuple[torch.Tensor]]:
    """Activations with three outlier channels (20x the others), as LLM activations have."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(rows, d_in, generator=gen)
        x[:, :3] *= 20.0
        out.append((x,))
    return out


def test_folds_into_a_norm_parameter_and_the_up_projection() -> None:
    """gate/up's scale goes into the norm's weight (a get_attr mul), down's into up's rows: no node added."""
    torch.manual_seed(0)
    net = _GatedBlock().eval()
    data = _outlier_batches(16)
    mg = ForgeGraph(net, data[0])
    out, info = awq(mg, {"config": INT4, "data": data})
    assert info.scaled_into["down"].startswith("up (Linear rows, mul ")
    assert info.scaled_into["gate"] == info.scaled_into["up"] and info.scaled_into["up"].startswith("norm_weight (mul ")
    assert info.layers["gate"]["alpha"] == info.layers["up"]["alpha"] > 0
    assert _scale_nodes(out) == 0
    _float_view(out)
    with torch.no_grad():
        for rows in (5, 9):
            x = torch.randn(3, rows, 16)
            _assert_same(net(x), out(x))


def _layer_error(mg: ForgeGraph, ref: nn.Linear, x: torch.Tensor) -> float:
    """‖layer output - float output‖² on ``x``, read at the graph's first linear (after its input scale)."""
    seen: list[torch.Tensor] = []
    handle = mg.model.get_submodule("0").register_forward_hook(lambda _m, _i, o: seen.append(o))
    with torch.no_grad():
        mg(x)
        handle.remove()
        return float((seen[0] - ref(x)).pow(2).sum())


@pytest.mark.parametrize("config", [INT4, MXINT4], ids=["int4", "mxint4"])
def test_error_at_most_round_to_nearest_with_outlier_channels(config: dict) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = _outlier_batches(16)
    mg = ForgeGraph(net, data[0])
    aq, info = awq(mg, {"config": config, "data": data})
    rq, _ = get_pass("quantize_transform_pass")(mg, config)
    x = torch.cat([b[0] for b in data])
    e_awq, e_rtn = _layer_error(aq, net[0], x), _layer_error(rq, net[0], x)
    assert e_awq < e_rtn, (e_awq, e_rtn)
    energy = float(net[0](x).detach().pow(2).sum())  # the info's relative errors are these, read from XᵀX
    assert info.layers["0"]["awq"] == pytest.approx(e_awq / energy, rel=1e-3)
    assert info.layers["0"]["rtn"] == pytest.approx(e_rtn / energy, rel=1e-3)
    assert all(e["awq"] <= e["rtn"] for e in info.layers.values())
    assert [type(m) for m in aq.model.modules() if hasattr(m, "weight_quantizer")] == \
        [type(m) for m in rq.model.modules() if hasattr(m, "weight_quantizer")]
    with torch.no_grad():
        ref = net(x)
        assert (aq(x) - ref).pow(2).sum() < (rq(x) - ref).pow(2).sum()
    clipped, cinfo = awq(mg, {"config": config, "data": data, "clip": True})
    assert all(cinfo.layers[p]["awq"] <= info.layers[p]["awq"] for p in info.layers)


def test_checkpoint_rebuilds_the_scale_nodes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    data = _outlier_batches(16)
    aq, _ = awq(ForgeGraph(net, data[0]), {"config": INT4, "data": data})
    assert _scale_nodes(aq) == 2
    loaded = ForgeGraph.from_checkpoint(aq.export(tmp_path / "awq"))
    assert _scale_nodes(loaded) == 2
    x = data[1][0]
    torch.testing.assert_close(loaded(x), aq(x))


@pytest.mark.parametrize(("first", "first_args"), [("fuse_kernels_transform_pass", {}),
                                                   ("insert_lora_adapter_transform_pass", {"rank": 2}),
                                                   ("prune_transform_pass", {"weight": {"sparsity": 0.3}})],
                         ids=["functional", "lora", "pruned"])
def test_scales_functional_lora_and_pruned_linears_exactly(first: str, first_args: dict) -> None:
    """A functional linear over a parameter (fuse_kernels' Linear + GELU), a LoRA-wrapped linear (lora_A scaled with
    the base weight, a trained lora_B) and a pruned one (masks kept) are scaled, exactly before quantization."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    data = _outlier_batches(16, n=3)
    mg, _ = get_pass("add_common_metadata_analysis_pass")(ForgeGraph(net, data[0]))
    mg, _ = get_pass(first)(mg, first_args)
    with torch.no_grad():
        for m in mg.model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.normal_(std=0.05)
    out, info = awq(mg, {"config": INT4, "data": data})
    assert set(info.layers) == {"0", "2"} and not info.skipped and info.layers["0"]["alpha"] > 0
    assert all(e["awq"] < e["rtn"] for e in info.layers.values())
    _float_view(out)
    with torch.no_grad():
        for x in (data[2][0][:5], data[1][0][:9]):
            _assert_same(mg(x), out(x))


class _SharedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(torch.relu(self.fc(x))))


def test_refusals_and_skips() -> None:
    torch.manual_seed(0)
    data = _outlier_batches(16, n=2)
    mg = ForgeGraph(_SharedLinear().eval(), data[0])
    _, info = awq(mg, {"config": INT4, "data": data})
    assert "called from 2 nodes" in info.skipped["fc"] and set(info.layers) == {"head"}
    with pytest.raises(PassArgsError, match="weight_widht"):
        awq(mg, {"config": {"linear": {"config": {"name": "integer", "weight_widht": 4}}}, "data": data})
    with pytest.raises(PassArgsError, match="alpah"):
        awq(mg, {"config": INT4, "data": data, "alpah": 0.5})
    with pytest.raises(PassArgsError, match="no Linear weight"):
        awq(mg, {"config": {"conv2d": INT4["linear"]}, "data": data})
    # split graphs (and quantized / activation-checkpointed ones) are refused as quantize_transform_pass refuses
    # them, by the pass decorator (running split_stages here costs seconds; test_compose runs the pair)
    assert "pipeline-stages" in awq.spec.forbids
    assert set(awq.spec.forbids) == set(get_pass("quantize_transform_pass").spec.forbids)


@pytest.mark.slow  # an HF export capture (seconds); the gated-block test covers the same folds unmarked
def test_scaling_alone_keeps_tiny_llama_outputs_at_two_shapes() -> None:
    """HF Llama as torch.export captures it: q/k/v and gate/up scales folded into the RMSNorm weights (``weight * x``
    products), down_proj's into up_proj's rows, o_proj's in a ChannelScale node."""
    from hf_tiny import hf_inputs, tiny_hf

    model = tiny_hf("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:2] *= 20.0
            layer.post_attention_layernorm.weight[:2] *= 20.0

    def inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in hf_inputs("llama", batch, seq).items() if k != "labels"}

    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"])
    out, info = awq(mg, {"config": INT4, "data": [inputs(2, 12)]})
    for b in (0, 1):
        block = f"model.layers.{b}"
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            assert info.scaled_into[f"{block}.{proj}"].startswith(f"{block}.input_layernorm.weight (mul ")
        assert info.scaled_into[f"{block}.mlp.down_proj"].startswith(f"{block}.mlp.up_proj (Linear rows")
        assert info.scaled_into[f"{block}.self_attn.o_proj"].endswith("(ChannelScale)")
    assert all(e["awq"] <= e["rtn"] for e in info.layers.values())
    _float_view(out)
    with torch.no_grad():
        for batch, seq in ((2, 9), (3, 13)):
            x = inputs(batch, seq)
            _assert_same(mg(**x).logits, out(**x).logits)
