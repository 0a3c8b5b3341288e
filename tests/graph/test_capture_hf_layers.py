"""HF layers after capture: GPT-2's Conv1D as a linear (LoRA merge checked against PEFT, quantization,
the selector), ResNet's Conv2d/BatchNorm2d as modules, and CaptureError hints that match the cause."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hf_tiny import hf_inputs, tiny_hf

from fxforge import CaptureError, ForgeGraph, passes
from fxforge.passes.select import select_modules

CONV1D = ("transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.1.mlp.c_fc")


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, ForgeGraph]:
    model = tiny_hf("gpt2")
    return model, ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"], share_weights=True)


def test_conv1d_is_a_linear_call_module_sharing_hf_storage(gpt2: tuple[nn.Module, ForgeGraph]) -> None:
    model, mg = gpt2
    called = {str(n.target) for n in mg.nodes if n.op == "call_module"}
    for path in CONV1D:
        layer, conv = mg.model.get_submodule(path), model.get_submodule(path)
        assert path in called and type(layer) is nn.Linear
        assert layer.weight.shape == conv.weight.t().shape and layer.weight.data_ptr() == conv.weight.data_ptr()
        assert layer.bias is conv.bias
    assert not any("addmm" in str(n.target) for n in mg.nodes)
    linear = {path for path, _ in select_modules(mg.model, {"type": "linear"})}
    assert set(CONV1D) <= linear and len(linear) == 9  # 4 Conv1D per block x 2 + lm_head


def test_lora_merge_matches_peft_fan_in_fan_out(gpt2: tuple[nn.Module, ForgeGraph]) -> None:
    import peft  # a requirement (requirements.txt): never skipped
    model, base = gpt2
    mg, info = passes.insert_lora_adapter_transform_pass(base.copy(), {"rank": 2, "alpha": 4.0,
                                                                       "targets": {"name": ["c_attn", "c_fc"]}})
    assert sorted(info.adapted) == sorted(f"transformer.h.{i}.{p}" for i in (0, 1)
                                          for p in ("attn.c_attn", "mlp.c_fc"))
    config = peft.LoraConfig(r=2, lora_alpha=4.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                             lora_dropout=0.0)
    ref = peft.get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(5)
    for path in info.adapted:
        ours, theirs = mg.model.get_submodule(path), ref.base_model.model.get_submodule(path)
        with torch.no_grad():
            ours.lora_A.copy_(torch.randn(ours.lora_A.shape, generator=gen))
            ours.lora_B.copy_(torch.randn(ours.lora_B.shape, generator=gen) * 0.1)
            theirs.lora_A["default"].weight.copy_(ours.lora_A)
            theirs.lora_B["default"].weight.copy_(ours.lora_B)
    inputs = hf_inputs("gpt2", 2, 9)
    del inputs["labels"]
    mg.eval()
    with torch.no_grad():
        want = ref.eval()(**inputs).logits
        assert (mg(**inputs).logits - want).abs().max() <= 1e-5
    mg, _ = passes.fuse_lora_weights_transform_pass(mg)
    merged = ref.merge_and_unload()
    for path in info.adapted:  # the fused linear's weight is PEFT's merged Conv1D weight, transposed
        assert (mg.model.get_submodule(path).weight - merged.get_submodule(path).weight.t()).abs().max() <= 1e-6
    with torch.no_grad():
        assert (mg(**inputs).logits - want).abs().max() <= 1e-5


def test_quantize_by_linear_finds_every_conv1d(gpt2: tuple[nn.Module, ForgeGraph]) -> None:
    cfg = {"name": "integer", "data_in_width": 16, "data_in_frac_width": 10, "weight_width": 16,
           "weight_frac_width": 12, "bias_width": 16, "bias_frac_width": 12}
    mg, info = passes.quantize_transform_pass(gpt2[1].copy(), {"by": "type", "default": {"config": {"name": None}},
                                                              "linear": {"config": cfg}})
    assert info.by_op == {"linear": 9}
    inputs = hf_inputs("gpt2", 2, 9)
    del inputs["labels"]
    mg.eval()
    with torch.no_grad():
        assert (mg(**inputs).logits - gpt2[0](**inputs).logits).abs().max() < 5e-2


def test_resnet_conv_and_batchnorm_modules_follow_train_and_eval() -> None:
    model = tiny_hf("resnet")
    twin = copy.deepcopy(model)
    mg = ForgeGraph(model, hf_input_names=["pixel_values"])
    kinds = {type(mg.model.get_submodule(str(n.target))) for n in mg.nodes if n.op == "call_module"}
    assert {nn.Conv2d, nn.BatchNorm2d} <= kinds
    x = hf_inputs("resnet", 4, 24)["pixel_values"]
    mg.train()
    twin.train()
    got, want = mg(pixel_values=x).logits, twin(pixel_values=x).logits
    assert (got - want).abs().max() <= 1e-5
    name = next(n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))
    bn, bn_twin = mg.model.get_submodule(name), twin.get_submodule(name)  # the graph's own copy of the layer
    assert torch.allclose(bn.running_mean, bn_twin.running_mean, atol=1e-6) and int(bn.num_batches_tracked) == 1
    mg.eval()
    twin.eval()
    with torch.no_grad():
        assert (mg(pixel_values=x).logits - twin(pixel_values=x).logits).abs().max() <= 1e-5
    assert int(bn.num_batches_tracked) == 1  # eval does not update the statistics


class _ReturnsObject(nn.Module):
    class Result:
        def __init__(self, value: torch.Tensor) -> None:
            self.value = value

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Result:
        return self.Result(self.lin(x))


def test_capture_error_names_a_non_tensor_output() -> None:
    with pytest.raises(CaptureError) as err:
        ForgeGraph(_ReturnsObject(), torch.randn(2, 4), frontend="export")
    text = str(err.value)
    assert "returns a" in text and "Result" in text and "register_pytree_node" in text
    assert "control flow" not in text and "leaf_modules" not in text


def test_capture_error_for_missing_decoder_inputs_says_which_inputs() -> None:
    with pytest.raises(CaptureError) as err:
        ForgeGraph(tiny_hf("t5"), hf_input_names=["input_ids", "attention_mask"])
    text = str(err.value)
    assert "rejected the inputs" in text and "decoder_input_ids" in text and "leaf_modules" not in text
