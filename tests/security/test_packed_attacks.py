"""Attacks on packed checkpoints from outside (issue 28): records a writer never produces -- parameters that
would make unpack allocate or overflow, scales and exponents that decode to NaN / inf, records whose format
is not the layer's configured one, ``prequantized`` set by hand, records on tensors no quantized layer owns --
are refused with a CheckpointError naming the tensor, by ``from_checkpoint`` and ``fxforge verify`` alike; a
record the loader accepts decodes to values of the format the layer's config names."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from security_helpers import edit_json, fresh_copy, rewrite, tiny_graph

from fxforge import CheckpointError, ForgeGraph, passes
from fxforge.graph.checkpoint_packed import packed_json
from fxforge.graph.packed import PackedTensor
from fxforge.passes.quantize.packing import pack_weight
from fxforge.passes.quantize.quantizer import Quantize

W = "fc.weight"  # Linear(4, 8) -> (8, 4)
FORMATS: dict[str, dict[str, Any]] = {
    "int4": {"name": "integer", "width": 4, "frac_width": 3},
    "int8_auto": {"name": "integer", "width": 8, "frac_width": "auto"},
    "scaled4": {"name": "scaled_integer", "width": 4},
    "scaled8_asym": {"name": "scaled_integer", "width": 8, "granularity": "per_channel", "symmetric": False},
    "mxint4": {"name": "mxint", "width": 4, "block_size": 32},
    "mxfp4": {"name": "mxfp", "width": 4, "exponent_width": 2, "block_size": 32},
}


def _config(spec: dict[str, Any], roles: tuple[str, ...] = ("weight", "bias")) -> dict[str, Any]:
    params = {k: v for k, v in spec.items() if k != "name"}
    return {"name": spec["name"], **{f"{r}_{k}": v for r in roles for k, v in params.items()}}


def _quantized(fmt: str, by_name: bool = False, data_in: bool = False) -> ForgeGraph:
    cfg = {"config": _config(FORMATS[fmt], ("data_in", "weight", "bias") if data_in else ("weight", "bias"))}
    args = {"by": "name", "fc": cfg} if by_name else {"by": "type", "linear": cfg}
    return passes.quantize_transform_pass(tiny_graph("fx"), args)[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in made:
            fmt, _, how = key.partition(":")
            mg = _quantized(fmt, by_name=how == "fc_only", data_in=how == "io")
            made[key] = mg.export(tmp_path_factory.mktemp("packed") / key.replace(":", "_"), pack=how != "float")
        return made[key]
    return get


@pytest.fixture
def copy(pristine: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    return lambda key: fresh_copy(pristine(key), tmp_path)


def _entry(doc: dict[str, Any], name: str = W) -> dict[str, Any]:
    return next(e for e in doc["tensors"] if e["name"] == name)


def _module(doc: dict[str, Any], path: str = "fc") -> dict[str, Any]:
    return next(m for m in doc["modules"] if m["path"] == path)


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load((ckpt / "weights.safetensors").read_bytes())


def _set_part(ckpt: Path, key: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    weights = _weights(ckpt)
    weights[key] = edit(weights[key].clone()).contiguous()
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))


def _refused(ckpt: Path, *matches: str) -> str:
    with pytest.raises(CheckpointError) as info:
        ForgeGraph.from_checkpoint(ckpt)
    for m in matches:
        assert m in str(info.value), str(info.value)
    return str(info.value)


def _transplant(ckpt: Path, name: str, packed: PackedTensor) -> None:
    """Store ``packed`` as tensor ``name``'s record (replacing its float value or old parts), as a forger would."""
    doc, parts = packed_json(name, packed)
    weights = {k: v for k, v in _weights(ckpt).items() if k != name and not k.startswith(f"{name}:")}
    weights.update(parts)
    edit_json(ckpt, "graph.json", lambda g: _entry(g, name).update(packed=doc))
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))


def _pack_as(spec: dict[str, Any], w: torch.Tensor) -> PackedTensor:
    params = {k: v for k, v in spec.items() if k != "name"}
    return pack_weight(Quantize({"format": spec["name"], **params}, "weight", is_param=True, channel_axis=0), w)


def test_pristine_checkpoints_reload_bit_exactly(pristine: Callable[[str], Path]) -> None:
    """The baseline every attack edits: each format's checkpoint packs fc.weight and reloads exactly."""
    x = torch.randn(5, 4)
    for fmt in FORMATS:
        mg = _quantized(fmt)
        back = ForgeGraph.from_checkpoint(pristine(fmt))
        assert "packed" in _entry(json.loads((pristine(fmt) / "graph.json").read_text()))
        assert torch.equal(back(x=x), mg(x=x)), fmt


# -- parameters: allocation, ranges, type confusion -------------------------------------------------------
@pytest.mark.parametrize("fmt, params", [
    ("mxint4", {"block_size": 1}),  # more exponents than stored bytes
    ("mxint4", {"block_size": 0}),
    ("mxint4", {"block_size": True}),
    ("mxint4", {"block_size": 32.0}),
    ("mxint4", {"axis": 2}),
    ("mxint4", {"axis": -1}),
    ("mxint4", {"flatten_from": 2}),
    ("mxint4", {"exponent_width": 0}),
    ("mxfp4", {"exponent_width": 3}),  # E3M0 is not an MX element
    ("int4", {"width": 32}),
    ("int4", {"width": True}),
    ("int4", {"width": 4.0}),
    ("int4", {"frac_width": 3.5}),
    ("int4", {"axis": 0}),  # fixed mode takes no axis
    ("scaled4", {"symmetric": 1}),
])
def test_codec_params_out_of_range_or_of_the_wrong_type_are_refused(copy: Callable[[str], Path], fmt: str,
                                                                    params: dict[str, Any]) -> None:
    ckpt = copy(fmt)
    edit_json(ckpt, "graph.json", lambda g: _entry(g)["packed"]["params"].update(params))
    _refused(ckpt, W)


def test_huge_shape_with_block_size_one_is_refused_before_decoding(copy: Callable[[str], Path]) -> None:
    """Record and module config both claim (65536, 65536) at block size 1: the parts check refuses it."""
    ckpt = copy("mxint4")

    def edit(g: dict[str, Any]) -> None:
        _entry(g).update(shape=[65536, 65536])
        _entry(g)["packed"]["params"].update(block_size=1)
        _module(g)["config"].update(in_features=65536, out_features=65536)
    edit_json(ckpt, "graph.json", edit)
    _refused(ckpt, W, "needs")


@pytest.mark.parametrize("shape", [[-8, 4], [8, 4.0], [8, True], [0, 4], [32], [8, 4, 1]])
def test_record_shape_other_than_the_modules_is_refused(copy: Callable[[str], Path], shape: list[Any]) -> None:
    ckpt = copy("int4")
    edit_json(ckpt, "graph.json", lambda g: _entry(g).update(shape=shape))
    _refused(ckpt, W)


@pytest.mark.parametrize("fmt, key, edit", [
    ("scaled4", f"{W}:scale", lambda t: t.view(torch.int32)),  # same bytes, other dtype
    ("scaled4", f"{W}:scale", lambda t: t.reshape(1).view(torch.uint8)),
    ("mxint4", f"{W}:codes", lambda t: t.view(torch.int8)),
    ("int8_auto", f"{W}:frac", lambda t: t.view(torch.uint8)),
])
def test_parts_of_another_dtype_with_the_same_bytes_are_refused(copy: Callable[[str], Path], fmt: str, key: str,
                                                                edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    ckpt = copy(fmt)
    _set_part(ckpt, key, edit)
    _refused(ckpt, W, "codec")


def test_nan_in_a_json_param_is_refused_by_the_json_reader(copy: Callable[[str], Path]) -> None:
    ckpt = copy("int4")
    edit_json(ckpt, "graph.json", lambda g: _entry(g)["packed"]["params"].update(frac_width=float("nan")))
    _refused(ckpt, "non-standard JSON constant NaN")


# -- data parts a writer never produces: NaN / inf scales, overflowing exponents, zero points ---------------
@pytest.mark.parametrize("fmt, key, edit", [
    ("scaled4", f"{W}:scale", lambda t: t.fill_(float("nan"))),
    ("scaled4", f"{W}:scale", lambda t: t.fill_(float("inf"))),
    ("scaled4", f"{W}:scale", lambda t: t.fill_(-1.0)),
    ("scaled4", f"{W}:scale", lambda t: t.fill_(0.0)),
    ("scaled4", f"{W}:scale", lambda t: t.fill_(3e38)),  # code 7 * 3e38 overflows float32
    ("scaled8_asym", f"{W}:zero_point", lambda t: t.fill_(float("nan"))),
    ("scaled8_asym", f"{W}:zero_point", lambda t: t.fill_(0.5)),  # not an integer: off the format's grid
    ("scaled8_asym", f"{W}:zero_point", lambda t: t.fill_(1e9)),  # outside the 8-bit code range
    ("scaled8_asym", f"{W}:scale", lambda t: t.fill_(float("-inf"))),
    ("int8_auto", f"{W}:frac", lambda t: t.fill_(-128)),  # code / 2^-128 overflows float32
    ("int8_auto", f"{W}:frac", lambda t: t.fill_(100)),  # the writer keeps fraction widths in [-64, 64]
    ("mxint4", f"{W}:exponents", lambda t: t.fill_(255)),  # 2^128: clamped, but -8 * 2^125 is -inf
    ("mxfp4", f"{W}:scales", lambda t: t.fill_(255)),  # E8M0 255 is NaN
    ("mxfp4", f"{W}:scales", lambda t: t.fill_(254)),  # 6.0 * 2^127 overflows float32
])
def test_parts_decoding_to_values_the_format_cannot_hold_are_refused(
        copy: Callable[[str], Path], fmt: str, key: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    ckpt = copy(fmt)
    if fmt == "mxint4":
        _set_part(ckpt, f"{W}:codes", lambda t: t.fill_(0x88))  # every code -8
    if fmt == "mxfp4":
        _set_part(ckpt, f"{W}:codes", lambda t: t.fill_(0x77))  # every element +6.0 (E2M1 0b0111)
    _set_part(ckpt, key, edit)
    _refused(ckpt, W)


# -- records that disagree with the layer's config ----------------------------------------------------------
@pytest.mark.parametrize("spec", [
    FORMATS["mxfp4"],  # another codec
    {"name": "integer", "width": 8, "frac_width": 5},  # the same codec at another width
    {"name": "integer", "width": 4, "frac_width": 1},  # the same width, another fraction width
    {"name": "integer", "width": 4, "frac_width": "auto"},  # another mode
])
def test_a_record_of_another_format_than_the_layers_config_is_refused(copy: Callable[[str], Path],
                                                                      spec: dict[str, Any]) -> None:
    """The int4 layer would pass the record's values through (prequantized) and silently compute in the
    record's format; the loader refuses a record its quantizer would not have written."""
    ckpt = copy("int4")
    torch.manual_seed(1)
    _transplant(ckpt, W, _pack_as(spec, torch.randn(8, 4)))
    _refused(ckpt, W, "not what its quantizer")


def test_a_record_with_another_block_axis_than_the_config_is_refused(copy: Callable[[str], Path]) -> None:
    ckpt = copy("mxint4")
    q = Quantize({"format": "mxint", "width": 4, "block_size": 32}, "weight", is_param=True, channel_axis=0,
                 block_axis=0)
    _transplant(ckpt, W, pack_weight(q, torch.randn(8, 4)))
    _refused(ckpt, W, "not what its quantizer")


def test_a_record_on_a_tensor_of_a_module_that_is_not_quantized_is_refused(copy: Callable[[str], Path]) -> None:
    ckpt = copy("int4:fc_only")
    _transplant(ckpt, "out.weight", _pack_as(FORMATS["int4"], torch.randn(3, 8)))
    _refused(ckpt, "out.weight", "does not quantize")


def test_a_record_whose_quantizer_is_not_marked_prequantized_is_refused(copy: Callable[[str], Path]) -> None:
    ckpt = copy("int4")
    edit_json(ckpt, "graph.json", lambda g: _module(g)["config"]["quantizers"]["weight"].update(prequantized=False))
    _refused(ckpt, W, "prequantized")


@pytest.mark.parametrize("key, role", [("int4:float", "weight"), ("int4:float", "bias"), ("int4:io", "data_in")])
def test_prequantized_set_by_hand_without_a_packed_record_is_refused(copy: Callable[[str], Path], key: str,
                                                                     role: str) -> None:
    """``prequantized: true`` on an fp32 weight (or an activation) would run the layer unquantized, silently."""
    ckpt = copy(key)
    ForgeGraph.from_checkpoint(ckpt)
    edit_json(ckpt, "graph.json", lambda g: _module(g)["config"]["quantizers"][role].update(prequantized=True))
    _refused(ckpt, "fc", role, "prequantized")


def test_a_packed_bias_on_a_layer_built_without_bias_is_refused(copy: Callable[[str], Path]) -> None:
    ckpt = copy("int4")
    edit_json(ckpt, "graph.json", lambda g: _module(g)["config"].update(bias=False))
    _refused(ckpt, "fc.bias")


@pytest.mark.parametrize("edit, match", [
    (lambda g: _entry(g, "out.weight")["packed"]["parts"].update(codes="fc.weight:codes"), "parts must map"),
    (lambda g: _entry(g, "out.weight").update(name="fc.weight:codes"), "fc.weight:codes"),
])
def test_part_keys_cannot_be_shared_or_collide_with_tensor_names(copy: Callable[[str], Path],
                                                                 edit: Callable[[dict[str, Any]], None],
                                                                 match: str) -> None:
    ckpt = copy("int4")
    edit_json(ckpt, "graph.json", edit)
    _refused(ckpt, match)


def test_reexport_of_a_reloaded_packed_graph_without_packing_reloads_quantized(copy: Callable[[str], Path],
                                                                               tmp_path: Path) -> None:
    """A careless round trip: packed -> reload -> export(pack=False) -> reload keeps the int4 values and the
    reloaded layer quantizes its (float-stored) weight again instead of passing it through."""
    back = ForgeGraph.from_checkpoint(copy("int4"))
    again = ForgeGraph.from_checkpoint(back.export(tmp_path / "float", pack=False))
    x = torch.randn(5, 4)
    assert torch.equal(again(x=x), back(x=x))
    assert not again.modules()["fc"].weight_quantizer.prequantized


def test_verify_names_the_tensor_in_one_line_without_a_traceback(copy: Callable[[str], Path],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.cli.app import main

    ckpt = copy("scaled4")
    _set_part(ckpt, f"{W}:scale", lambda t: t.fill_(float("nan")))
    assert main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert f"tensor '{W}'" in err and "scales must be finite" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0, err


class _TwoLinears(torch.nn.Module):
    """Two (4, 4) linears: ``a`` quantized, ``b`` not, so a forger can tie b's weight to a's packed one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_an_alias_of_a_packed_tensor_on_a_module_that_is_not_quantized_is_refused(tmp_path: Path) -> None:
    from fxforge import ExampleInputs

    mg = ForgeGraph(_TwoLinears().eval(), example_inputs=ExampleInputs((torch.randn(2, 4),), {}), frontend="fx")
    mg, _ = passes.quantize_transform_pass(mg, {"by": "name", "a": {"config": _config(FORMATS["int4"])}})
    ckpt = mg.export(tmp_path / "ckpt")

    def tie(g: dict[str, Any]) -> None:
        entry = _entry(g, "b.weight")
        entry.clear()
        entry.update(name="b.weight", kind="parameter", alias_of="a.weight", shape=[4, 4], dtype="float32")
    edit_json(ckpt, "graph.json", tie)
    weights = {k: v for k, v in _weights(ckpt).items() if k != "b.weight"}
    rewrite(ckpt, "weights.safetensors", safetensors.torch.save(weights))
    _refused(ckpt, "b.weight", "does not quantize")


def test_an_empty_packed_tensor_loads_or_is_refused_cleanly(copy: Callable[[str], Path]) -> None:
    """A (8, 0) weight of a Linear(0, 8): zero codes decode to an empty weight, nothing crashes."""
    ckpt = copy("int4")

    def edit(g: dict[str, Any]) -> None:
        _entry(g).update(shape=[8, 0])
        _module(g)["config"].update(in_features=0)
    edit_json(ckpt, "graph.json", edit)
    _set_part(ckpt, f"{W}:codes", lambda t: t[:0])
    back = ForgeGraph.from_checkpoint(ckpt)
    assert tuple(back.modules()["fc"].weight.shape) == (8, 0)


def test_verify_names_the_tensor_of_a_record_of_another_format(copy: Callable[[str], Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.cli.app import main

    ckpt = copy("int4")
    _transplant(ckpt, W, _pack_as(FORMATS["mxfp4"], torch.randn(8, 4)))
    assert main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert f"tensor '{W}'" in err and "not what its quantizer" in err and "Traceback" not in err


@pytest.mark.parametrize("step", ["add_", "data", "fused_adam"])
def test_a_reloaded_layer_whose_weight_changes_quantizes_it_again(copy: Callable[[str], Path], step: str) -> None:
    """A careless user fine-tunes a reloaded packed layer: its quantizer passes only the values it was loaded
    with through; changed values (in place, through ``.data``, by a fused optimizer that does not bump the
    version counter) are quantized again, never used as float weights behind an int4 config."""
    back = ForgeGraph.from_checkpoint(copy("int4"))
    fc = back.modules()["fc"]
    q = fc.weight_quantizer
    fresh = Quantize.from_config({**q.to_config(), "prequantized": False})
    assert q(fc.weight) is fc.weight  # the decoded int4 values, passed through bit for bit
    if step == "fused_adam":
        opt = torch.optim.Adam([fc.weight], lr=0.01, fused=True)
        fc.weight.grad = torch.randn_like(fc.weight)
        opt.step()
    else:
        with torch.no_grad():
            (fc.weight if step == "add_" else fc.weight.data).add_(0.01)
    assert torch.equal(q(fc.weight), fresh(fc.weight))
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(fc(x), torch.nn.functional.linear(x, fresh(fc.weight), fc.bias_quantizer(fc.bias)))
