"""torch.nn's activation, normalisation and shape modules in checkpoints (issue 27, finding 4: MobileNetV2's
ReLU6 was not in the allowlist): every class torch lists is registered or excluded with a reason, each
rebuilds exactly from its JSON config, and hostile configs are refused."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxforge import ForgeGraph
from fxforge.graph import nn_modules, targets
from fxforge.graph.targets import CheckpointError

R = torch.randn
Inputs = Callable[[], tuple[Any, ...]]


def _rand(*shape: int) -> Inputs:
    return lambda: (R(*shape),)


def _unpool_inputs(dims: int) -> Inputs:
    pool = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[dims - 1](2, return_indices=True)
    return lambda: pool(R(1, 2, *([4] * dims)))


# class → (constructor kwargs that differ from the defaults, a valid input)
CASES: dict[type[nn.Module], tuple[dict[str, Any], Inputs]] = {
    nn.Threshold: ({"threshold": 0.2, "value": -1.0, "inplace": True}, lambda: (R(2, 5),)),
    nn.ReLU: ({"inplace": True}, lambda: (R(2, 5),)),
    nn.RReLU: ({"lower": 0.1, "upper": 0.2}, lambda: (R(2, 5),)),
    nn.Hardtanh: ({"min_val": -2.0, "max_val": 0.5}, lambda: (R(2, 5),)),
    nn.ReLU6: ({"inplace": True}, lambda: (4 * R(2, 5),)),
    nn.Sigmoid: ({}, lambda: (R(2, 5),)),
    nn.Hardsigmoid: ({"inplace": True}, lambda: (4 * R(2, 5),)),
    nn.Tanh: ({}, lambda: (R(2, 5),)),
    nn.SiLU: ({"inplace": True}, lambda: (R(2, 5),)),
    nn.Mish: ({"inplace": True}, lambda: (R(2, 5),)),
    nn.Hardswish: ({"inplace": True}, lambda: (4 * R(2, 5),)),
    nn.ELU: ({"alpha": 0.5, "inplace": True}, lambda: (R(2, 5),)),
    nn.CELU: ({"alpha": 0.7}, lambda: (R(2, 5),)),
    nn.SELU: ({"inplace": True}, lambda: (R(2, 5),)),
    nn.GLU: ({"dim": 0}, lambda: (R(4, 3),)),
    nn.GELU: ({"approximate": "tanh"}, lambda: (R(2, 5),)),
    nn.Hardshrink: ({"lambd": 0.3}, lambda: (R(2, 5),)),
    nn.LeakyReLU: ({"negative_slope": 0.2, "inplace": True}, lambda: (R(2, 5),)),
    nn.LogSigmoid: ({}, lambda: (R(2, 5),)),
    nn.Softplus: ({"beta": 2.0, "threshold": 5.0}, lambda: (3 * R(2, 5),)),
    nn.Softshrink: ({"lambd": 0.3}, lambda: (R(2, 5),)),
    nn.MultiheadAttention: ({"embed_dim": 8, "num_heads": 2, "dropout": 0.1, "bias": False, "add_bias_kv": True,
                             "add_zero_attn": True, "kdim": 4, "vdim": 6, "batch_first": True},
                            lambda: (R(2, 3, 8), R(2, 5, 4), R(2, 5, 6))),
    nn.PReLU: ({"num_parameters": 3, "init": 0.1}, lambda: (R(2, 3, 4),)),
    nn.Softsign: ({}, lambda: (R(2, 5),)),
    nn.Tanhshrink: ({}, lambda: (R(2, 5),)),
    nn.Softmin: ({"dim": 0}, lambda: (R(2, 5),)),
    nn.Softmax: ({"dim": 1}, lambda: (R(2, 5),)),
    nn.Softmax2d: ({}, lambda: (R(2, 3, 4, 4),)),
    nn.LogSoftmax: ({"dim": 0}, lambda: (R(2, 5),)),
    # normalisation
    nn.LocalResponseNorm: ({"size": 3, "alpha": 1e-3, "beta": 0.5, "k": 2.0}, lambda: (R(2, 4, 5, 5),)),
    nn.CrossMapLRN2d: ({"size": 3, "alpha": 1e-3, "beta": 0.5, "k": 2.0}, lambda: (R(2, 4, 5, 5),)),
    nn.LayerNorm: ({"normalized_shape": [4, 5], "eps": 1e-3, "bias": False}, lambda: (R(2, 4, 5),)),
    nn.GroupNorm: ({"num_groups": 2, "num_channels": 4, "eps": 1e-3, "bias": False}, lambda: (R(2, 4, 5),)),
    nn.RMSNorm: ({"normalized_shape": [5], "eps": 1e-3, "elementwise_affine": False}, lambda: (R(2, 5),)),
    **{cls: ({"num_features": 4, "eps": 1e-3, "momentum": None, "bias": False}, _rand(3, 4, *d))
       for cls, d in ((nn.BatchNorm1d, (5,)), (nn.BatchNorm2d, (3, 3)), (nn.BatchNorm3d, (2, 2, 2)))},
    **{cls: ({"num_features": 4, "eps": 1e-3, "momentum": 0.2, "affine": True, "track_running_stats": True},
             _rand(3, 4, *d))
       for cls, d in ((nn.InstanceNorm1d, (5,)), (nn.InstanceNorm2d, (3, 3)), (nn.InstanceNorm3d, (2, 2, 2)))},
    # pooling
    nn.MaxPool1d: ({"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 2, "ceil_mode": True},
                   lambda: (R(2, 3, 10),)),
    nn.MaxPool2d: ({"kernel_size": [3, 2], "stride": 1, "return_indices": True}, lambda: (R(2, 3, 6, 6),)),
    nn.MaxPool3d: ({"kernel_size": 2, "padding": 1}, lambda: (R(1, 2, 4, 4, 4),)),
    nn.MaxUnpool1d: ({"kernel_size": 2, "stride": 2}, _unpool_inputs(1)),
    nn.MaxUnpool2d: ({"kernel_size": 2, "stride": [2, 2]}, _unpool_inputs(2)),
    nn.MaxUnpool3d: ({"kernel_size": 2, "padding": 0, "stride": 2}, _unpool_inputs(3)),
    nn.AvgPool1d: ({"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False},
                   lambda: (R(2, 3, 10),)),
    nn.AvgPool2d: ({"kernel_size": [3, 2], "divisor_override": 3}, lambda: (R(2, 3, 6, 6),)),
    nn.AvgPool3d: ({"kernel_size": 2, "stride": 1, "count_include_pad": False, "padding": 1},
                   lambda: (R(1, 2, 4, 4, 4),)),
    nn.LPPool1d: ({"norm_type": 3.0, "kernel_size": 3, "stride": 2}, lambda: (R(2, 3, 10).abs(),)),
    nn.LPPool2d: ({"norm_type": 2.0, "kernel_size": [2, 3], "ceil_mode": True}, lambda: (R(2, 3, 6, 6),)),
    nn.LPPool3d: ({"norm_type": 1.5, "kernel_size": 2, "stride": 1}, lambda: (R(1, 2, 4, 4, 4).abs(),)),
    nn.AdaptiveMaxPool1d: ({"output_size": 3, "return_indices": True}, lambda: (R(2, 3, 10),)),
    nn.AdaptiveMaxPool2d: ({"output_size": [2, None], "return_indices": True}, lambda: (R(2, 3, 6, 5),)),
    nn.AdaptiveMaxPool3d: ({"output_size": 2, "return_indices": True}, lambda: (R(1, 2, 4, 4, 4),)),
    nn.AdaptiveAvgPool1d: ({"output_size": 3}, lambda: (R(2, 3, 10),)),
    nn.AdaptiveAvgPool2d: ({"output_size": [None, 2]}, lambda: (R(2, 3, 6, 5),)),
    nn.AdaptiveAvgPool3d: ({"output_size": [1, 2, 3]}, lambda: (R(1, 2, 4, 4, 4),)),
    # padding
    **{cls: ({"padding": [1, 2, 0, 1, 2, 1][: 2 * d]}, _rand(1, 2, *([4] * d)))
       for cls, d in ((nn.CircularPad1d, 1), (nn.CircularPad2d, 2), (nn.CircularPad3d, 3), (nn.ReflectionPad1d, 1),
                      (nn.ReflectionPad2d, 2), (nn.ReflectionPad3d, 3), (nn.ReplicationPad1d, 1),
                      (nn.ReplicationPad2d, 2), (nn.ReplicationPad3d, 3), (nn.ZeroPad1d, 1), (nn.ZeroPad2d, 2),
                      (nn.ZeroPad3d, 3))},
    **{cls: ({"padding": 1 if d == 3 else [2, 1, 0, 1][: 2 * d], "value": 0.5},
             _rand(1, 2, *([3] * d)))
       for cls, d in ((nn.ConstantPad1d, 1), (nn.ConstantPad2d, 2), (nn.ConstantPad3d, 3))},
    # shapes, upsampling, dropout
    nn.Flatten: ({"start_dim": 0, "end_dim": 1}, lambda: (R(2, 3, 4),)),
    nn.Unflatten: ({"dim": 1, "unflattened_size": [2, 3]}, lambda: (R(2, 6, 4),)),
    nn.Upsample: ({"scale_factor": [2.0, 1.5], "mode": "bilinear", "align_corners": True}, lambda: (R(1, 2, 4, 4),)),
    nn.UpsamplingNearest2d: ({"scale_factor": 2.0}, lambda: (R(1, 2, 3, 3),)),
    nn.UpsamplingBilinear2d: ({"size": [5, 7]}, lambda: (R(1, 2, 3, 3),)),
    nn.PixelShuffle: ({"upscale_factor": 2}, lambda: (R(1, 8, 3, 3),)),
    nn.PixelUnshuffle: ({"downscale_factor": 2}, lambda: (R(1, 2, 4, 4),)),
    nn.ChannelShuffle: ({"groups": 2}, lambda: (R(1, 4, 3, 3),)),
    **{cls: ({"p": 0.3, "inplace": True}, _rand(2, 4, *([3] * d)))
       for cls, d in ((nn.Dropout, 1), (nn.Dropout1d, 1), (nn.Dropout2d, 2), (nn.Dropout3d, 3), (nn.AlphaDropout, 1),
                      (nn.FeatureAlphaDropout, 2))},
    nn.Identity: ({}, lambda: (R(2, 3),)),
    nn.Bilinear: ({"in1_features": 3, "in2_features": 4, "out_features": 5, "bias": False},
                  lambda: (R(2, 3), R(2, 4))),
    nn.Conv3d: ({"in_channels": 2, "out_channels": 4, "kernel_size": [3, 2, 1], "padding": "same",
                 "dilation": [2, 1, 1], "groups": 2, "bias": False, "padding_mode": "reflect"},
                lambda: (R(1, 2, 5, 5, 5),)),
    **{cls: ({"in_channels": 2, "out_channels": 4, "kernel_size": 3, "stride": 2, "padding": 1, "output_padding": 1,
              "groups": 2, "bias": False, "dilation": 1}, _rand(1, 2, *([4] * d)))
       for cls, d in ((nn.ConvTranspose1d, 1), (nn.ConvTranspose2d, 2), (nn.ConvTranspose3d, 3))},
}


def _torch_lists(*families: Any) -> list[type[nn.Module]]:
    return [getattr(f, name) for f in families for name in f.__all__]


def test_every_torch_activation_and_normalisation_module_is_registered_or_excluded_with_a_reason() -> None:
    from torch.nn.modules import activation, batchnorm, instancenorm, normalization

    listed = _torch_lists(activation, normalization, batchnorm, instancenorm, *nn_modules.FAMILIES)
    assert len(listed) > 80 and nn.ReLU6 in listed and nn.RMSNorm in listed
    for cls in listed:
        if cls in nn_modules.EXCLUDED:
            assert len(nn_modules.EXCLUDED[cls]) > 40, cls  # a reason, not a placeholder
            with pytest.raises(CheckpointError, match="not in the checkpoint allowlist"):
                targets.resolve_module(f"torch.nn.{cls.__name__}")
            continue
        spec = targets.resolve_module(f"torch.nn.{cls.__name__}")
        assert spec.cls is cls and spec.keys == set(nn_modules.constructor_keys(cls)), cls
    # the exclusions are the lazy modules and the three classes a checkpoint cannot reproduce, nothing else
    assert {c for c in nn_modules.EXCLUDED if not c.__name__.startswith("Lazy")} == {
        nn.SyncBatchNorm, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d}


def test_config_keys_are_the_constructor_parameters() -> None:
    assert set(nn_modules.REGISTERED) == set(CASES)  # every registered class has a round-trip case below
    assert set(nn_modules.constructor_keys(nn.GroupNorm)) == {"num_groups", "num_channels", "eps", "affine", "bias"}
    assert set(nn_modules.constructor_keys(nn.Hardtanh)) == {"min_val", "max_val", "inplace"}  # not the aliases


def _fill(module: nn.Module) -> None:
    """Random (positive) values in every float tensor, so a mix-up of tensors changes outputs."""
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point():
                t.uniform_(0.5, 1.5)


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_module_rebuilds_exactly_from_its_json_config(cls: type[nn.Module]) -> None:
    kwargs, inputs = CASES[cls]
    call_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    torch.manual_seed(0)
    module = cls(**call_kwargs).eval()
    _fill(module)
    spec = targets.module_spec_for(module)
    assert spec.name == f"torch.nn.{cls.__name__}" and spec.to_config and spec.from_config
    config = json.loads(json.dumps(spec.to_config(module), allow_nan=False))
    for key, given in kwargs.items():  # the values given, read back (torch widens an int to one per dimension)
        assert config[key] == given or isinstance(given, int) and config[key] == [given] * len(config[key]), key
    defaults = {k: p.default for k, p in nn_modules.constructor_keys(cls).items()
                if p.default is not inspect.Parameter.empty}
    assert not defaults or any(config[k] != v for k, v in defaults.items()), "use non-default values"
    with torch.device("meta"):
        assert spec.to_config(spec.from_config(config)) == config  # as the loader builds it
    rebuilt = spec.from_config(config).eval()
    assert type(rebuilt) is cls
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in module.state_dict().items()}
    rebuilt.load_state_dict(module.state_dict())
    args = inputs()
    want, got = module(*[a.clone() for a in args]), rebuilt(*[a.clone() for a in args])
    for w, g in zip(pytree.tree_leaves(want), pytree.tree_leaves(got), strict=True):
        assert torch.equal(w, g)


class MobileBlock(nn.Module):
    """The layers of a MobileNet/EfficientNet-style block that fx keeps as modules."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.ReLU6())
        self.dw = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(8, 8, 3, stride=2, groups=8),
                                nn.BatchNorm2d(8), nn.Hardswish())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4), nn.GELU("tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.dw(self.stem(x))))


def _mobile_block() -> nn.Module:
    torch.manual_seed(0)
    model = MobileBlock()
    _fill(model)
    return model.eval()


@pytest.fixture(scope="module")
def block_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[ForgeGraph, Path]:
    g = ForgeGraph(_mobile_block(), example_inputs=(R(2, 3, 16, 16),), frontend="fx")
    kinds = {type(m) for m in g.model.modules()}
    assert {nn.ReLU6, nn.Hardswish, nn.InstanceNorm2d, nn.AdaptiveAvgPool2d} <= kinds  # kept as modules
    return g, g.export(tmp_path_factory.mktemp("block") / "ckpt")


def test_checkpoint_with_relu6_hardswish_instancenorm_and_adaptive_pool_round_trips_exactly(
        block_ckpt: tuple[ForgeGraph, Path]) -> None:
    g, path = block_ckpt
    loaded = ForgeGraph.from_checkpoint(path).eval()
    eager = _mobile_block()
    for shape in ((2, 3, 16, 16), (1, 3, 24, 20)):
        x = R(*shape)
        assert torch.equal(loaded(x), eager(x)) and torch.equal(g.eval()(x), eager(x))


FRESH_LOAD = """
import sys, safetensors.torch, torch
from fxforge import ForgeGraph
io = safetensors.torch.load_file(sys.argv[2])
assert torch.equal(ForgeGraph.from_checkpoint(sys.argv[1]).eval()(io["x"]), io["want"])
print("ok")
"""


def test_a_fresh_process_loads_the_checkpoint_without_importing_nn_modules_itself(
        block_ckpt: tuple[ForgeGraph, Path], tmp_path: Path) -> None:
    _, path = block_ckpt
    x = R(2, 3, 16, 16)
    safetensors.torch.save_file({"x": x, "want": _mobile_block()(x).detach()}, tmp_path / "io.safetensors")
    run = subprocess.run([sys.executable, "-c", FRESH_LOAD, str(path), str(tmp_path / "io.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


def test_tiny_mobilenet_v2_exports_and_reloads_with_zero_difference(tmp_path: Path) -> None:
    import transformers as T

    torch.manual_seed(0)
    # tf_padding=False: TF-style padding reads the image size as a Python int, so that graph is fixed to 32x32
    config = T.MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=3, tf_padding=False)
    model = T.MobileNetV2ForImageClassification(config).eval()
    g = ForgeGraph(model, hf_input_names=["pixel_values"])
    assert any(type(m) is nn.ReLU6 for m in g.model.modules())
    loaded = ForgeGraph.from_checkpoint(g.export(tmp_path / "mnv2")).eval()
    for batch, side in ((2, 32), (3, 24)):  # the graph accepts sides up to the 32 it was captured at
        x = R(batch, 3, side, side)
        with torch.no_grad():
            want = model(pixel_values=x).logits
            assert torch.equal(loaded(pixel_values=x).logits, want)
            assert torch.equal(g.eval()(pixel_values=x).logits, want)


# Configs as the hand-written registrations before nn_modules wrote them (no BatchNorm/GroupNorm "bias").
OLD_CONFIGS = [
    ("BatchNorm2d", {"num_features": 4, "eps": 1e-05, "momentum": 0.1, "affine": True, "track_running_stats": True}),
    ("BatchNorm1d", {"num_features": 4, "eps": 1e-05, "momentum": None, "affine": False, "track_running_stats": True}),
    ("GroupNorm", {"num_groups": 2, "num_channels": 4, "eps": 1e-05, "affine": True}),
    ("LayerNorm", {"normalized_shape": [8], "eps": 1e-05, "elementwise_affine": False, "bias": True}),
    ("LayerNorm", {"normalized_shape": [4, 8], "eps": 1e-05, "elementwise_affine": True, "bias": False}),
    ("GELU", {"approximate": "tanh"}), ("Softmax", {"dim": -1}), ("Dropout", {"p": 0.1, "inplace": False}),
    ("Tanh", {}), ("Identity", {}), ("ReLU", {"inplace": False}),
]


@pytest.mark.parametrize(("name", "config"), OLD_CONFIGS, ids=lambda x: str(x)[:40])
def test_configs_written_by_the_old_registrations_still_load(name: str, config: dict[str, Any]) -> None:
    spec = targets.resolve_module(f"torch.nn.{name}")
    assert spec.from_config is not None and spec.to_config is not None
    with torch.device("meta"):
        module = spec.from_config(config)
    written = spec.to_config(module)
    assert {k: written[k] for k in config} == config and set(written) - set(config) <= {"bias"}


class AttentionPool(nn.Module):
    """A pooling head as SigLIP/CLIP-style towers build it, with the parametrized activations and norms."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2.0, mode="bilinear")
        self.norm = nn.RMSNorm(8, eps=1e-4)
        self.act = nn.PReLU(8, init=0.1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
        self.query = nn.Parameter(torch.randn(1, 1, 8))
        self.out = nn.Sequential(nn.LayerNorm(8, bias=False), nn.Softmax(dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.act(self.norm(self.up(x).flatten(2).transpose(1, 2)).transpose(1, 2)).transpose(1, 2)
        pooled, _ = self.attn(self.query.expand(x.shape[0], -1, -1), tokens, tokens)
        return self.out(pooled)


def test_attention_pool_with_parametrized_activations_round_trips_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AttentionPool().eval()
    g = ForgeGraph(model, example_inputs=(R(2, 8, 3, 3),), frontend="fx")
    assert {nn.MultiheadAttention, nn.PReLU, nn.RMSNorm, nn.Upsample} <= {type(m) for m in g.model.modules()}
    loaded = ForgeGraph.from_checkpoint(g.export(tmp_path / "pool")).eval()
    for shape in ((2, 8, 3, 3), (3, 8, 4, 5)):
        x = R(*shape)
        assert torch.equal(loaded(x), model(x))


# -- hostile configs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "config", "match"), [
    ("ReLU6", {"inplace": False, "evil": 1}, "unknown keys"),
    ("ReLU6", {"inplace": 1}, r"\['inplace'\] = 1 is not a"),
    ("AdaptiveAvgPool2d", {"output_size": "2"}, "output_size"),
    ("LayerNorm", {"normalized_shape": [4], "eps": "1e-5"}, "eps"),
    ("LayerNorm", {"normalized_shape": [4.5]}, "normalized_shape"),
    ("BatchNorm2d", {"num_features": True}, "num_features"),
    ("GELU", {"approximate": "sigmoid"}, r"allowed: \['none', 'tanh'\]"),
    ("Upsample", {"scale_factor": 2.0, "mode": "__import__('os')"}, "mode"),
    ("Conv3d", {"in_channels": 2, "out_channels": 2, "kernel_size": 1, "padding_mode": "evil"}, "padding_mode"),
    ("Conv3d", {"in_channels": 2, "out_channels": 2, "kernel_size": 1, "padding": "full"}, "padding"),
    ("MaxPool2d", {"kernel_size": [2, [2]]}, "kernel_size"),
    ("Softplus", {"beta": {"x": 1}}, "beta"),
    ("GroupNorm", {"num_groups": 3, "num_channels": 4}, "constructor refuses"),
    ("GroupNorm", {"num_channels": 4}, "required keys"),
    ("LayerNorm", {"normalized_shape": [4], "elementwise_affine": False, "bias": False}, "do not read back"),
    ("MaxPool2d", {"kernel_size": 2, "stride": None}, "do not read back"),
    ("Softplus", {"beta": 10**400}, "beta"),  # an int standing for a float must be one exactly
    ("LayerNorm", {"normalized_shape": [2**70]}, "constructor refuses"),
])
def test_hostile_configs_are_refused(name: str, config: dict[str, Any], match: str) -> None:
    spec = targets.resolve_module(f"torch.nn.{name}")
    assert spec.from_config is not None
    with torch.device("meta"), pytest.raises(CheckpointError, match=match):
        spec.from_config(config)


@pytest.mark.parametrize(("cls", "value", "match"), [
    ("ReLU6", {"inplace": False, "evil": 1}, "not constructor keys"),
    ("ReLU6", {"inplace": "yes"}, "inplace"),
    ("AdaptiveAvgPool2d", {"output_size": "1"}, "output_size"),
    ("GELU", {"approximate": "erf"}, "approximate"),
])
def test_hostile_configs_in_a_checkpoint_are_refused_on_load(block_ckpt: tuple[ForgeGraph, Path], tmp_path: Path,
                                                             cls: str, value: dict[str, Any], match: str) -> None:
    path = Path(shutil.copytree(block_ckpt[1], tmp_path / "ckpt"))
    doc = json.loads((path / "graph.json").read_text())
    next(m for m in doc["modules"] if m["class"] == f"torch.nn.{cls}")["config"] = value
    (path / "graph.json").write_text(json.dumps(doc))
    manifest = json.loads((path / "manifest.json").read_text())  # re-signed, as an attacker would
    data = (path / "graph.json").read_bytes()
    manifest["files"]["graph.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=match):
        ForgeGraph.from_checkpoint(path)
