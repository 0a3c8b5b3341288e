"""The checkpoint allowlist: what resolves, what never does, and how users extend it."""

from __future__ import annotations

import json
import operator
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from fxforge.graph import targets
from fxforge.graph.modules import ScaledDotProductAttention
from fxforge.graph.targets import CheckpointError


@pytest.mark.parametrize("fn", [
    torch.ops.aten.linear.default, torch.ops.aten.add.Tensor, torch.ops.aten.add, torch.ops.aten.__and__.Tensor,
    torch.ops.aten.fft_rfft.default, torch.ops.prims.convert_element_type.default,
    F.relu, F.scaled_dot_product_attention, F.gelu, torch.add, torch.fft.rfft, torch.fft.irfft,
    torch.linalg.norm, torch.special.erf, torch.arange, torch.zeros, torch.full, torch.zeros_like,
    operator.add, operator.getitem, operator.setitem, getattr, torch.Tensor.view,
])
def test_allowed_functions_round_trip_by_name(fn: Any) -> None:
    name = targets.function_name(fn)
    assert isinstance(name, str) and targets.resolve_function(name) is fn


@pytest.mark.parametrize("name", [
    "os.system", "builtins.eval", "builtins.exec", "builtins.__import__", "builtins.open", "torch.save",
    "torch.load", "torch.from_file", "torch.autocast", "operator.call", "operator.methodcaller",
    "operator.attrgetter", "subprocess.run", "torch.ops.aten.from_file.default", "torch.ops.os.system.default",
    "torch.ops.aten.no_such_op.default", "torch.ops.aten.add.no_such_overload", "torch.ops.aten.__dict__",
    "torch.ops.aten.linear.default.extra", "torch.Tensor.numpy", "torch.Tensor.register_hook", "",
])
def test_everything_else_is_refused(name: str) -> None:
    with pytest.raises(CheckpointError) as err:
        targets.resolve_function(name)
    assert repr(name) in str(err.value) or f"({name!r})" in str(err.value) or f"in {name!r}" in str(err.value)


@pytest.mark.parametrize("fn", [print, eval, open, torch.save, torch.load, lambda x: x])
def test_unlisted_callables_have_no_name(fn: Any) -> None:
    with pytest.raises(CheckpointError, match="register_function"):
        targets.function_name(fn)


def test_factories_and_io_are_split_correctly() -> None:
    table = targets._builtin_functions()
    assert {"torch.arange", "torch.ones", "torch.randn", "torch.tensor", "torch.full_like"} <= set(table)
    assert not {"torch.save", "torch.load", "torch.from_file", "torch.set_default_dtype"} & set(table)


@pytest.mark.parametrize("method", ["view", "reshape", "transpose", "contiguous", "size", "masked_fill", "to"])
def test_tensor_methods_allowed(method: str) -> None:
    assert targets.check_method(method) == method


@pytest.mark.parametrize("method", ["numpy", "register_hook", "type", "apply_", "storage", "untyped_storage",
                                    "__setstate__", "__reduce_ex__", "system", 3])
def test_dangerous_methods_refused(method: Any) -> None:
    with pytest.raises(CheckpointError, match="not an allowed Tensor method"):
        targets.check_method(method)


def test_getattr_reads_only_public_literal_attributes() -> None:
    targets.check_call("builtins.getattr", (None, "shape"), {})
    for bad in ("__class__", "_private", 3, "a.b"):
        with pytest.raises(CheckpointError, match="public attributes"):
            targets.check_call("builtins.getattr", (None, bad), {})


def _custom_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@pytest.mark.usefixtures("restore_registries")
def test_register_function_plain_and_decorator_and_conflict() -> None:
    targets.register_function(_custom_scale, name="tests.custom_scale")
    assert targets.resolve_function("tests.custom_scale") is _custom_scale
    assert targets.function_name(_custom_scale) == "tests.custom_scale"

    @targets.register_function(name="tests.decorated")
    def decorated(x: torch.Tensor) -> torch.Tensor:
        return x

    assert targets.resolve_function("tests.decorated") is decorated
    with pytest.raises(ValueError, match="already registered"):
        targets.register_function(decorated, name="tests.custom_scale")


@pytest.mark.usefixtures("restore_registries")
def test_register_op_namespace() -> None:
    with pytest.raises(CheckpointError, match="register_op_namespace"):
        targets.resolve_function("torch.ops.quantized.linear.default")
    with pytest.raises(ValueError):
        targets.register_op_namespace("bad.name")


STANDARD_LAYERS = [
    nn.Linear(4, 3), nn.Linear(4, 3, bias=False), nn.Embedding(10, 4, padding_idx=0), nn.LayerNorm(8, eps=1e-5),
    nn.LayerNorm([4, 8], bias=False), nn.LayerNorm(8, elementwise_affine=False), nn.Conv1d(2, 4, 3, stride=2),
    nn.Conv2d(3, 6, (3, 5), padding="same", bias=False), nn.Conv2d(3, 6, 3, padding=(1, 2), dilation=2, groups=3),
    nn.Dropout(0.3), nn.BatchNorm1d(5, momentum=None), nn.BatchNorm2d(4, affine=False), nn.GroupNorm(2, 4),
    nn.ReLU(), nn.GELU("tanh"), nn.SiLU(), nn.Tanh(), nn.Sigmoid(), nn.Softmax(dim=-1), nn.LogSoftmax(dim=1),
    nn.Identity(), ScaledDotProductAttention(dropout_p=0.1, is_causal=True, scale=0.5),
]


@pytest.mark.parametrize("module", STANDARD_LAYERS, ids=lambda m: repr(m))
def test_standard_layers_rebuild_from_json_config(module: nn.Module) -> None:
    spec = targets.module_spec_for(module)
    assert spec.to_config is not None and spec.from_config is not None
    config = json.loads(json.dumps(spec.to_config(module)))
    rebuilt_spec = targets.resolve_module(spec.name)
    with torch.device("meta"):
        rebuilt = rebuilt_spec.from_config(config)  # type: ignore[misc]
    assert type(rebuilt) is type(module)
    assert rebuilt_spec.to_config(rebuilt) == config  # type: ignore[misc]
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == {n: p.shape for n, p in module.named_parameters()}
    assert {n: b.shape for n, b in rebuilt.named_buffers()} == {n: b.shape for n, b in module.named_buffers()}


def test_containers_and_unknown_modules() -> None:
    for cls in (nn.Module, nn.ModuleList, nn.ModuleDict, nn.Sequential):
        assert targets.module_spec_for(cls()).container

    class Mystery(nn.Linear):  # a subclass is not its parent: its forward may differ
        pass

    with pytest.raises(CheckpointError, match=r"Mystery is not in the checkpoint allowlist.*register_module"):
        targets.module_spec_for(Mystery(2, 2))
    for bad in ("os.system", "transformers.models.bert.modeling_bert.BertSelfAttention", None):
        with pytest.raises(CheckpointError, match="register_module"):
            targets.resolve_module(bad)


@pytest.mark.usefixtures("restore_registries")
def test_register_module_for_a_user_layer() -> None:
    class Scale(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(n))

    spec = targets.register_module(Scale, lambda m: {"n": m.w.numel()}, lambda c: Scale(**c), name="tests.Scale")
    assert targets.resolve_module("tests.Scale") is spec and targets.module_spec_for(Scale(3)) is spec
    with pytest.raises(ValueError, match="both"):
        targets.register_module(Scale, lambda m: {})


@pytest.mark.parametrize("name", ["builtins.tuple", "builtins.dict", "collections.OrderedDict",
                                  "transformers.modeling_outputs.SequenceClassifierOutput"])
def test_pytree_types_allowed(name: str) -> None:
    targets.check_pytree_type(name)
    assert name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE


@pytest.mark.parametrize("name", ["os.system", "subprocess.Popen", "transformers_evil.X", "transformers.no_such.X",
                                  "transformers.modeling_outputs.NoSuchOutput", "transformers.a b.X", 7])
def test_pytree_types_refused(name: Any) -> None:
    with pytest.raises(CheckpointError, match="pytree type"):
        targets.check_pytree_type(name)


Pair = namedtuple("Pair", "a b")


@pytest.mark.usefixtures("restore_registries")
def test_user_namedtuple_pytree_type() -> None:
    pytree._register_namedtuple(Pair, serialized_type_name="tests.Pair")
    spec = json.loads(pytree.treespec_dumps(pytree.tree_structure(Pair(1, 2))))
    with pytest.raises(CheckpointError, match="namedtuple 'tests.Pair'"):
        targets.check_treespec_json(spec)
    targets.register_pytree_type(Pair)
    targets.check_treespec_json(spec)
    with pytest.raises(ValueError, match="serialized_type_name"):
        targets.register_pytree_type(set)
