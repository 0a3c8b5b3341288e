"""Packed checkpoints: every quantized weight stored at its format's width reloads bit-exactly, tied weights
stay stored once, ``pack=False`` keeps the float weights, and the stored bytes match the weight accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert

from fxforge import ExampleInputs, ForgeGraph, passes
from fxforge.graph.verify import measure_weights, verify_checkpoint
from fxforge.passes.quantize.packing import PACKERS
from fxforge.passes.quantize.quantizer import Quantize
from fxforge.search.objectives import weight_bits

# One role spec per format (weight and bias), as the quantize pass's flat config keys.
FORMATS: dict[str, dict[str, Any]] = {
    "int4_fixed": {"name": "integer", "width": 4, "frac_width": 3},
    "int8_auto": {"name": "integer", "width": 8, "frac_width": "auto"},
    "scaled4_tensor": {"name": "scaled_integer", "width": 4},
    "scaled8_channel_asym": {"name": "scaled_integer", "width": 8, "granularity": "per_channel", "symmetric": False},
    "fp8_e4m3": {"name": "minifloat", "width": 8, "exponent_width": 4, "special": "fn"},
    "block_fp6": {"name": "block_fp", "width": 6, "block_size": 16},
    "mxint4": {"name": "mxint", "width": 4, "block_size": 32},
    "mxfp4": {"name": "mxfp", "width": 4, "exponent_width": 2, "block_size": 32},
}


def _op(spec: dict[str, Any], roles: tuple[str, ...] = ("weight", "bias")) -> dict[str, Any]:
    params = {k: v for k, v in spec.items() if k != "name"}
    return {"config": {"name": spec["name"], **{f"{r}_{k}": v for r in roles for k, v in params.items()}}}


def quant_config(spec: dict[str, Any], ops: tuple[str, ...] = ("linear", "layer_norm", "embedding")) -> dict[str, Any]:
    cfg: dict[str, Any] = {"by": "type", "default": {"config": {"name": None}}}
    for op in ops:
        cfg[op] = _op(spec, ("weight",) if op == "embedding" else ("weight", "bias"))
    return cfg


def quantized_bert(spec: dict[str, Any]) -> ForgeGraph:
    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = passes.quantize_transform_pass(mg, quant_config(spec))
    return mg


def _bert_outputs(mg: ForgeGraph) -> list[torch.Tensor]:
    with torch.no_grad():
        return [mg(**bert_inputs(batch=b, seq=s, labels=False)).logits for b, s in ((3, 11), (1, 17))]


def _graph_doc(path: Path) -> dict[str, Any]:
    return json.loads((path / "graph.json").read_text())


def _quantized_params(mg: ForgeGraph) -> dict[str, str]:
    """name of every quantized parameter -> its format."""
    out = {}
    for path, m in mg.model.named_modules():
        for role, q in getattr(m, "quantizers", dict)().items() if callable(getattr(m, "quantizers", None)) else ():
            if role in ("weight", "bias") and isinstance(getattr(m, role, None), torch.Tensor):
                out[f"{path}.{role}"] = q.fmt.name
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bert_reloads_bit_exactly_with_each_format_packed(fmt: str, tmp_path: Path) -> None:
    """Each format with a codec is stored packed (no float copy) and reloads to outputs equal to the in-memory
    graph's at two input shapes; a format without one is stored fp32 with the reason, still exact."""
    mg = quantized_bert(FORMATS[fmt])
    expected = _bert_outputs(mg)
    path = mg.export(tmp_path / "ckpt")
    doc = _graph_doc(path)
    entries = {e["name"]: e for e in doc["tensors"]}
    stored = safetensors.torch.load((path / "weights.safetensors").read_bytes())
    quantized = _quantized_params(mg)
    assert len(quantized) > 20  # linears (weight + bias), layer norms, embeddings
    packable = FORMATS[fmt]["name"] in PACKERS
    for name in quantized:
        if packable:
            record = entries[name]["packed"]
            assert name not in stored and all(key in stored for key in record["parts"].values())
        else:
            assert "packed" not in entries[name] and "no codec" in entries[name]["unpacked"] and name in stored
    back = ForgeGraph.from_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(_bert_outputs(back), expected, strict=True))
    prequantized = {p for p, m in back.model.named_modules() if isinstance(m, Quantize) and m.prequantized}
    assert len(prequantized) == (len(quantized) if packable else 0)
    again = back.export(tmp_path / "again")
    assert _files(again) == _files(path)  # export -> reload -> export is byte-identical


class ConvNet(nn.Module):
    """Conv1d and Conv2d (kernels quantized flattened to (out, in * kernel)) and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv2(x)).flatten(2)
        return self.head(torch.relu(self.conv1(y)).mean(-1))


@pytest.mark.parametrize("fmt", ["int4_fixed", "scaled8_channel_asym", "mxint4", "fp8_e4m3"])
def test_conv_layers_reload_bit_exactly(fmt: str, tmp_path: Path) -> None:
    mg = ForgeGraph(ConvNet().eval(), example_inputs=torch.randn(2, 3, 6, 6))
    mg, _ = passes.quantize_transform_pass(mg, quant_config(FORMATS[fmt], ("conv1d", "conv2d", "linear")))
    xs = [torch.randn(2, 3, 6, 6), torch.randn(5, 3, 4, 7)]
    with torch.no_grad():
        expected = [mg(x) for x in xs]
    path = mg.export(tmp_path / "conv")
    packed = [e["name"] for e in _graph_doc(path)["tensors"] if "packed" in e]
    assert len(packed) == (6 if FORMATS[fmt]["name"] in PACKERS else 0)
    back = ForgeGraph.from_checkpoint(path)
    with torch.no_grad():
        assert all(torch.equal(back(x), y) for x, y in zip(xs, expected, strict=True))


class TiedLM(nn.Module):
    """An embedding and an output projection sharing one weight (GPT's wte / lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 40, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(idx)))


def _tied(tmp_path: Path, emb: dict[str, Any], out: dict[str, Any]) -> tuple[ForgeGraph, ForgeGraph, Path]:
    mg = ForgeGraph(TiedLM().eval(), example_inputs=torch.randint(0, 40, (2, 7)))
    cfg = {"by": "name", "emb": _op(emb, ("weight",)), "out": _op(out, ("weight",))}
    mg, _ = passes.quantize_transform_pass(mg, cfg)
    path = mg.export(tmp_path / "tied")
    return mg, ForgeGraph.from_checkpoint(path), path


def test_tied_weight_quantized_alike_is_stored_once_packed(tmp_path: Path) -> None:
    mg, back, path = _tied(tmp_path, FORMATS["int4_fixed"], FORMATS["int4_fixed"])
    entries = {e["name"]: e for e in _graph_doc(path)["tensors"]}
    assert "packed" in entries["emb.weight"] and entries["out.weight"]["alias_of"] == "emb.weight"
    assert set(safetensors.torch.load((path / "weights.safetensors").read_bytes())) >= {"emb.weight:codes"}
    assert back.model.get_submodule("out").weight is back.model.get_submodule("emb").weight
    assert back.model.get_submodule("out").weight_quantizer.prequantized
    idx = torch.randint(0, 40, (3, 9))
    with torch.no_grad():
        assert torch.equal(back(idx), mg(idx))
    assert _files(back.export(tmp_path / "again")) == _files(path)


def test_tied_weight_quantized_differently_stays_fp32(tmp_path: Path) -> None:
    mg, back, path = _tied(tmp_path, FORMATS["int4_fixed"], {"name": "integer", "width": 8, "frac_width": 5})
    entries = {e["name"]: e for e in _graph_doc(path)["tensors"]}
    assert "packed" not in entries["emb.weight"] and "differently" in entries["emb.weight"]["unpacked"]
    assert torch.equal(back.model.get_submodule("emb").weight, mg.model.get_submodule("emb").weight)
    idx = torch.randint(0, 40, (3, 9))
    with torch.no_grad():
        assert torch.equal(back(idx), mg(idx))


def test_pack_false_keeps_float_weights_for_qat(tmp_path: Path) -> None:
    mg = quantized_bert(FORMATS["int4_fixed"])
    path = mg.export(tmp_path / "float", pack=False)
    assert not any("packed" in e or "unpacked" in e for e in _graph_doc(path)["tensors"])
    back = ForgeGraph.from_checkpoint(path)
    name = "bert.encoder.layer.0.attention.self.query"
    assert torch.equal(back.model.get_submodule(name).weight, mg.model.get_submodule(name).weight)
    assert not any(isinstance(m, Quantize) and m.prequantized for m in back.model.modules())


def test_prequantized_quantizer_passes_values_through_and_round_trips_its_config() -> None:
    spec = {"format": "scaled_integer", "width": 4}
    q = Quantize(spec, "weight", is_param=True, prequantized=True)
    x = torch.randn(5, 7)
    assert q(x) is x and not torch.equal(Quantize(spec, "weight", is_param=True)(x), x)
    assert q.to_config()["prequantized"] is True
    assert Quantize.from_config(q.to_config()).prequantized
    assert Quantize.from_config({k: v for k, v in q.to_config().items() if k != "prequantized"}).prequantized is False


def test_stored_bytes_match_weight_bits_accounting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Quantized tiny BERT (4-bit linears and embeddings): the weight bytes stored equal the accounting
    within 5%; verify and `fxforge verify` print both."""
    from fxforge.cli.app import main

    mg = quantized_bert(FORMATS["mxint4" if "mxint" in PACKERS else "int4_fixed"])
    mg.example_inputs = ExampleInputs((), bert_inputs(labels=False))
    path = mg.export(tmp_path / "bert")
    stored = measure_weights(path)
    accounted = weight_bits(mg) / 8
    assert stored.packed_tensors == len(_quantized_params(mg)) and not stored.unpacked_quantized
    assert abs(stored.weights - accounted) <= 0.05 * accounted, (stored, accounted)
    report, _ = verify_checkpoint(path, weight_bits=weight_bits)
    assert report.ok and report.stored == stored and report.accounted_bytes == pytest.approx(accounted)
    assert f"stored {stored.weights:,} B = {stored.packed:,} B packed" in report.text()
    assert f"accounted weight_bits/8 {accounted:,.0f} B" in report.text()
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{stored.packed:,} B packed ({stored.packed_tensors} tensors) + {stored.unpacked:,} B unpacked" in out
    assert f"accounted weight_bits/8 {accounted:,.0f} B (stored/accounted " in out


def test_an_older_schema_checkpoint_still_loads(tmp_path: Path) -> None:
    """Schema 3 (float weights, no packed records) loads as before."""
    from conftest import rehash_manifest

    mg = quantized_bert(FORMATS["int4_fixed"])
    path = mg.export(tmp_path / "v3", pack=False)
    for name in ("graph.json", "manifest.json"):
        doc = json.loads((path / name).read_text())
        doc["schema_version"] = 3
        (path / name).write_text(json.dumps(doc))
    rehash_manifest(path)
    back = ForgeGraph.from_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(_bert_outputs(back), _bert_outputs(mg), strict=True))


class MLP(nn.Module):
    """An embedding, two linears and a layer norm: 656k parameters, so the weights outweigh the JSON files."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 128)
        self.up = nn.Linear(128, 512)
        self.down = nn.Linear(512, 128)
        self.norm = nn.LayerNorm(128)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(self.emb(idx)))))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def test_all_4bit_checkpoint_is_8x_smaller_on_disk(tmp_path: Path) -> None:
    """Every parameter at 4 bits: the weight file is ~8x smaller than fp32, the whole directory (JSON included)
    over 7x."""
    mg = ForgeGraph(MLP().eval(), example_inputs=torch.randint(0, 4096, (1, 4)))
    fp32 = mg.export(tmp_path / "fp32")
    mg, _ = passes.quantize_transform_pass(mg, quant_config(FORMATS["int4_fixed"]))
    packed = mg.export(tmp_path / "int4")
    weights = [(p / "weights.safetensors").stat().st_size for p in (fp32, packed)]
    assert 7.8 <= weights[0] / weights[1] <= 8.0, weights
    assert 7.0 <= _dir_bytes(fp32) / _dir_bytes(packed) <= 8.0
    stored = measure_weights(packed)
    assert stored.unpacked == 0 and stored.packed == pytest.approx(weight_bits(mg) / 8, abs=1)
