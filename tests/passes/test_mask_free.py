"""mask_free_activations_transform_pass: ReLU / softshrink rewritten so that compiled backwards save no bool
mask; outputs bitwise and gradients unchanged (eager and under compile, two lengths, both frontends);
args validated; other graphs unchanged; rewritten graphs reload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_reloads_and_exports, make_gpt
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from fxforge import ForgeGraph, passes
from fxforge.graph.metadata import get_meta
from fxforge.passes.transform.afno_real import afno_real_arithmetic_transform_pass
from fxforge.passes.transform.mask_free import (
    MaskFreeArgs,
    _ReLU,
    _Softshrink,
    mask_free_activations_transform_pass,
    mask_free_relu,
    mask_free_softshrink,
)

SPECIAL = [float("inf"), -float("inf"), 0.0, -0.0, 0.01, -0.01, 0.5, -0.5, 1e-30, -1e-30]


def _meta(mg: ForgeGraph) -> ForgeGraph:
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


@pytest.mark.parametrize(("function", "reference"), [
    (_ReLU.apply, F.relu),
    (lambda x: _Softshrink.apply(x, 0.01), lambda x: F.softshrink(x, 0.01)),
])
def test_compiled_forms_match_torch_bitwise(function: Callable[..., torch.Tensor],
                                            reference: Callable[..., torch.Tensor]) -> None:
    """The autograd functions used under compile: outputs and gradients bitwise, thresholds and +-inf too."""
    values = torch.cat([torch.tensor(SPECIAL), torch.randn(200), torch.randn(200) * 0.01])
    x1, x2 = values.clone().requires_grad_(), values.clone().requires_grad_()
    g = torch.randn_like(values)
    y1, y2 = function(x1), reference(x2)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)  # type: ignore[arg-type]


def test_nan_input_gradient_is_the_documented_difference() -> None:
    x = torch.tensor([float("nan"), 1.0], requires_grad=True)
    _ReLU.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0]))  # PyTorch's relu passes 1 for NaN


class _Mixer(nn.Module):
    """A block MLP whose activations are read through views, as AFNO's are: the partitioner keeps bool masks."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = F.relu(x @ w).transpose(0, 1)
        return F.softshrink(h @ w, 0.01).sum()


def _saved_dtypes(model: nn.Module, *inputs: torch.Tensor) -> list[torch.dtype]:
    """dtypes of what Inductor's partitioner (min-cut) saves for the backward: the forward graph's outputs
    after the model's own (one scalar here). No Inductor: the graphs are run as they are."""
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _: object) -> Callable[..., object]:
        graphs.append(gm)
        return make_boxed_func(gm)

    torch.compiler.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition)
    torch.compile(model, backend=backend, dynamic=False)(*inputs).backward()
    out = next(n for n in graphs[0].graph.nodes if n.op == "output")
    return [n.meta["val"].dtype for n in out.args[0][1:] if isinstance(n.meta.get("val"), torch.Tensor)]


def test_rewritten_graph_saves_no_bool_mask_for_backward() -> None:
    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    base = _meta(ForgeGraph(_Mixer(), example_inputs=(x, w), frontend="fx"))
    assert torch.bool in _saved_dtypes(base.model, x, w)  # the problem the pass exists for
    mg, info = mask_free_activations_transform_pass(base.copy())
    assert info.rewritten == {"relu": 1, "softshrink": 1}
    saved = _saved_dtypes(mg.model, x, w)
    assert saved and torch.bool not in saved


def _out_and_grads(model: Callable[[torch.Tensor], torch.Tensor], params: nn.Module,
                   x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    params.zero_grad(set_to_none=True)
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_afno_gpt_outputs_and_gradients_unchanged(frontend: str) -> None:
    idx = torch.randint(0, 64, (2, 16))
    base = _meta(ForgeGraph(make_gpt("afno"), example_inputs=idx, frontend=frontend))
    base, _ = afno_real_arithmetic_transform_pass(base)
    mg, info = mask_free_activations_transform_pass(base.copy())
    assert info.rewritten == {"relu": 2, "softshrink": 2} and info.skipped == ()
    assert sum(n.target in (mask_free_relu, mask_free_softshrink) for n in mg.model.graph.nodes) == 4
    fresh = _meta(mg.copy())  # the metadata the rewrite left equals what the metadata passes compute afresh
    assert all(get_meta(a).common.to_json() == get_meta(b).common.to_json()
               for a, b in zip(mg.model.graph.nodes, fresh.model.graph.nodes, strict=True))
    compiled = torch.compile(mg.model, backend="aot_eager", dynamic=False)
    for seq in (16, 32):
        x = torch.randint(0, 64, (2, seq))
        o1, g1 = _out_and_grads(base.model, base.model, x)
        for model in (mg.model, compiled):  # eager (plain ops) and traced (the mask-free autograd functions)
            o2, g2 = _out_and_grads(model, mg.model, x)
            assert torch.equal(o1, o2) and g1.keys() == g2.keys()
            for name in g1:
                torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=1e-5, msg=name)


class _Forms(nn.Module):
    """ReLU as a function, a module and in place (a flag, an op); softshrink as a function and a module."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.shrink = nn.Softshrink(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(x)
        b = self.act(x * 2)
        c = F.relu(x * 3, inplace=True)
        d = torch.relu_(x * 4)
        return a + b + c + d + F.softshrink(x, lambd=0.25) + self.shrink(x)


def test_args_are_validated_and_selectors_apply() -> None:
    x = torch.randn(3, 5)
    base = _meta(ForgeGraph(_Forms(), example_inputs=x, frontend="fx"))
    with pytest.raises(passes.PassArgsError, match="allowed"):
        mask_free_activations_transform_pass(base.copy(), {"ops": ["gelu"]})
    with pytest.raises(passes.PassArgsError, match="ops"):
        mask_free_activations_transform_pass(base.copy(), {"op": ["relu"]})
    mg, info = mask_free_activations_transform_pass(base.copy(), {"ops": ["relu"], "exclude": {"name": "act"}})
    assert info.rewritten == {"relu": 1} and info.names == ("relu",) and info.skipped == ("relu_1", "relu_")
    _, info = mask_free_activations_transform_pass(base.copy(), {"targets": {"name": ["act", "softshrink"]},
                                                                 "ops": ["relu"]})
    assert info.rewritten == {"relu": 1} and info.names == ("act",)  # targets and ops both restrict
    assert MaskFreeArgs().ops == ("relu", "softshrink")
    mg, info = mask_free_activations_transform_pass(base.copy())
    assert info.rewritten == {"relu": 2, "softshrink": 2} and info.skipped == ("relu_1", "relu_")  # in place
    assert [n.args[1] for n in mg.model.graph.nodes if n.target is mask_free_softshrink] == [0.25, 0.1]
    assert torch.equal(mg(x), base(x))


def test_graph_without_the_activations_is_unchanged() -> None:
    idx = torch.randint(0, 64, (2, 8))
    mg = _meta(ForgeGraph(make_gpt("attn"), example_inputs=idx, frontend="fx"))
    code = mg.model.code
    mg, info = mask_free_activations_transform_pass(mg)
    assert info.rewritten == {} and mg.model.code == code


def test_rewritten_graph_reloads_and_exports(tmp_path: Path) -> None:
    idx = torch.randint(0, 64, (2, 16))
    mg, _ = mask_free_activations_transform_pass(_meta(ForgeGraph(make_gpt("afno"), example_inputs=idx)))
    assert_reloads_and_exports(mg, idx, tmp_path / "mask_free", mask_free_softshrink, 2)
