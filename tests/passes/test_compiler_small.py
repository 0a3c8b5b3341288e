"""Each compiler pass on a small graph built for it: what it merges, keeps, moves, batches, folds."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import make_agru

from fxforge import ForgeGraph, passes
from fxforge.passes.compiler.purity import is_pure

aten = torch.ops.aten


def _count(mg: ForgeGraph, target: object) -> int:
    return sum(1 for n in mg.model.graph.nodes if n.target == target)


class TwiceSin(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2 + torch.sin(x) * 2


def test_cse_merges_duplicated_pure_ops_export_and_fx() -> None:
    x = torch.randn(3, 4)
    for frontend in ("export", "fx"):
        mg = ForgeGraph(TwiceSin(), x, frontend=frontend)
        mg, info = passes.cse_transform_pass(mg)
        assert info.merged == 2, (frontend, info)  # one sin, one "* 2"
        assert info.nodes_after == info.nodes_before - 2
        y = torch.randn(5, 4)
        torch.testing.assert_close(mg(y), TwiceSin()(y), rtol=0, atol=0)


class DropTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x) - self.drop(x)


def test_cse_never_merges_train_mode_dropout() -> None:
    mg = ForgeGraph(DropTwice(), torch.ones(64, 64), frontend="fx").train()
    mg, info = passes.cse_transform_pass(mg)
    assert info.merged == 0
    assert sum(1 for n in mg.model.graph.nodes if n.op == "call_module") == 2
    torch.manual_seed(0)
    assert mg(torch.ones(64, 64)).abs().sum() > 0  # two independent masks: merged they would cancel


class RandTwice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape) - torch.rand(x.shape) + F.dropout(x, 0.5, True) - F.dropout(x, 0.5, True)


def test_cse_never_merges_random_factories_or_functional_dropout() -> None:
    for frontend in ("export", "fx"):
        mg = ForgeGraph(RandTwice(), torch.ones(8, 8), frontend=frontend, dynamic=False).train()
        randoms = [n for n in mg.model.graph.nodes if "rand" in str(n.target) or "ropout" in str(n.target)]
        mg, _ = passes.cse_transform_pass(mg)
        left = [n for n in mg.model.graph.nodes if "rand" in str(n.target) or "ropout" in str(n.target)]
        assert len(left) == len(randoms) >= 2, frontend
        assert not any(is_pure(n, mg.model) for n in left)


class InPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        b = x * 2
        a.add_(1)
        return a + b


def test_cse_never_merges_values_written_in_place() -> None:
    mg = ForgeGraph(InPlace(), torch.randn(3), frontend="fx")
    mg, info = passes.cse_transform_pass(mg)
    assert info.merged == 0
    x = torch.randn(3)
    torch.testing.assert_close(mg(x), InPlace()(x))


def test_dce_removes_dead_pure_nodes_and_unused_parameter_reads_but_keeps_effects() -> None:
    mg = ForgeGraph(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), frontend="fx")
    graph = mg.model.graph
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        w = graph.get_attr("0.weight")
        graph.call_function(torch.sin, (w,))
        x = next(n for n in graph.nodes if n.op == "placeholder")
        clone = graph.call_method("clone", (x,))
        graph.call_method("add_", (clone, 1))  # an effect on a dead value: kept
    mg.recompile()
    mg, info = passes.dce_transform_pass(mg)
    assert info.removed == 2 and info.parameter_reads_removed == 1
    assert any(n.target == "add_" for n in mg.model.graph.nodes)
    assert "0.weight" in dict(mg.model.named_parameters())


class ParamChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        a = self.W - self.W.t() - 0.1 * torch.eye(4)
        z = y @ a
        return z @ (self.W - self.W.t() - 0.1 * torch.eye(4))


def test_hoist_moves_parameter_only_chain_to_top_once_and_stays_differentiable() -> None:
    model = ParamChain()
    mg = ForgeGraph(model, torch.randn(2, 4), frontend="export")
    mg, info = passes.hoist_parameter_subgraphs_transform_pass(mg)
    assert info.hoisted >= 4 and info.merged >= 4  # the second copy of the chain merges into the first
    nodes = list(mg.model.graph.nodes)
    first_input_use = min(i for i, n in enumerate(nodes) if n.op == "call_function"
                          and any(a.op == "placeholder" for a in n.all_input_nodes))
    eye = [i for i, n in enumerate(nodes) if n.target == aten.eye.default]
    assert len(eye) == 1 and eye[0] < first_input_use
    x = torch.randn(3, 4)
    out = mg(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    model.W.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(mg.model.get_parameter("W").grad, model.W.grad)
    with torch.no_grad():  # the graph reads the live weight: an update shows up in the next call
        mg.model.get_parameter("W").add_(1.0)
        model.W.add_(1.0)
    torch.testing.assert_close(mg(x), model(x))


class PerStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.Vz = nn.Parameter(torch.randn(6, 5))
        self.Vh = nn.Parameter(torch.randn(6, 5))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.size(0), 6)
        outs = []
        for t in range(x.size(1)):
            h = torch.tanh(h + x[:, t] @ self.Vz.t() + self.b) * torch.sigmoid(x[:, t] @ self.Vh.t())
            outs.append(h)
        return torch.stack(outs, 1)


def test_batched_projection_equals_per_step_values_and_gradients() -> None:
    model = PerStep()
    x = torch.randn(3, 4, 5)
    mg = ForgeGraph(model, x, frontend="export")
    ref = mg.copy()
    mg, _ = passes.cse_transform_pass(mg)
    mg, _ = passes.hoist_parameter_subgraphs_transform_pass(mg)
    mg, info = passes.batch_matmuls_transform_pass(mg)
    assert info.sequence_batched == 8 and info.sequence_groups == 2
    assert info.sibling_batched == 2 and info.sibling_groups == 1
    assert info.biases_absorbed == 4
    assert _count(mg, aten.unbind.int) == 2 and _count(mg, aten.cat.default) == 1
    matmuls = [n for n in mg.model.graph.nodes if n.target == aten.matmul.default]
    assert len(matmuls) == 1  # x @ cat([Vzᵀ, Vhᵀ]) over the whole sequence
    y = torch.randn(7, 4, 5)
    out, expected = mg(y), ref(y)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    ref(y).square().sum().backward()
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(mg.model.get_parameter(name).grad, p.grad, rtol=1e-5, atol=1e-5)


def test_fuse_elementwise_makes_addcmul_within_one_rounding() -> None:
    class Update(nn.Module):
        def forward(self, h: torch.Tensor, z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return h + 0.1 * z * c

    args = (torch.randn(4, 8), torch.rand(4, 8), torch.randn(4, 8))
    mg = ForgeGraph(Update(), args, frontend="export")
    mg, info = passes.fuse_elementwise_transform_pass(mg)
    assert info.addcmul == 1 and _count(mg, aten.addcmul.default) == 1
    assert _count(mg, aten.mul.Tensor) == 0
    new = (torch.randn(6, 8), torch.rand(6, 8), torch.randn(6, 8))
    torch.testing.assert_close(mg(*new), Update()(*new), rtol=1e-6, atol=1e-7)


def test_fold_constants_stores_buffers_in_eval_and_refuses_train_mode() -> None:
    model = make_agru()
    x = torch.randn(2, 3, 8)
    mg = ForgeGraph(model, x).train()
    with pytest.raises(passes.PassError, match="train mode"):
        passes.fold_constants_transform_pass(mg)
    assert not passes.holds("constants-folded", mg)
    mg.eval()
    mg, _ = passes.cse_transform_pass(mg)
    mg, info = passes.fold_constants_transform_pass(mg)
    assert info.folded >= 2 and info.nodes_after < info.nodes_before
    assert passes.holds("constants-folded", mg)
    assert _count(mg, aten.eye.default) == 0
    y = torch.randn(5, 3, 8)
    torch.testing.assert_close(mg(y), model(y), rtol=1e-6, atol=1e-6)
    with pytest.warns(UserWarning, match="folded"):
        mg.train()


def test_pipeline_rejects_unknown_steps() -> None:
    mg = ForgeGraph(TwiceSin(), torch.randn(2, 2), frontend="fx")
    with pytest.raises(ValueError, match="allowed"):
        passes.optimize_graph_pipeline(mg, skip=("csee",))
