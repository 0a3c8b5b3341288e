"""A checkpoint keeps each tensor's memory layout (a permuted view is stored in memory order with its ``dim_order``),
so a reloaded graph runs the same BLAS paths bit for bit; a tampered ``dim_order`` is refused naming the tensor."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from security_helpers import edit_json, fresh_copy

from fxforge import CheckpointError, ExampleInputs, ForgeGraph


class Permuted(nn.Module):
    """A linear whose weight is the transposed view of an [in, out] tensor (HF Conv1D seen as nn.Linear) and a
    3-d buffer stored permuted; both shape the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 24)
        self.lin.weight = nn.Parameter(torch.randn(16, 24).t())
        self.register_buffer("table", torch.randn(3, 24, 2).permute(1, 2, 0))  # (24, 2, 3), dim order [2, 0, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(self.lin(x), self.table, dims=1)


@pytest.fixture(scope="module", params=["fx", "export"])
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ForgeGraph, Path]:
    torch.manual_seed(0)
    g = ForgeGraph(Permuted().eval(), example_inputs=ExampleInputs((), {"x": torch.randn(7, 16)}),
                   frontend=request.param)
    return g, g.export(tmp_path_factory.mktemp("pristine") / "ckpt")


def _entry(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in doc["tensors"] if e["name"] == name)


def test_permuted_tensors_reload_with_their_layout(pristine: tuple[ForgeGraph, Path]) -> None:
    g, path = pristine
    back = ForgeGraph.from_checkpoint(path)
    before, after = dict(g.model.named_parameters()), dict(back.model.named_parameters())
    before.update(g.model.named_buffers())
    after.update(back.model.named_buffers())
    assert before["lin.weight"].stride() == (1, 24) and before["table"].stride() == (2, 1, 48)
    for name, t in before.items():
        assert after[name].stride() == t.stride() and torch.equal(after[name], t), name
    for rows in (1, 7, 33):
        x = torch.randn(rows, 16)
        assert torch.equal(back(x=x), g(x=x))


@pytest.mark.parametrize("order", [[0, 0], [1], [1, 2], ["1", 0], [1.0, 0], None, "10"])
def test_dim_order_must_permute_the_recorded_dims(pristine: tuple[ForgeGraph, Path], tmp_path: Path,
                                                  order: Any) -> None:
    ckpt = fresh_copy(pristine[1], tmp_path)
    edit_json(ckpt, "graph.json", lambda doc: _entry(doc, "lin.weight").update(dim_order=order))
    if order is None:  # no order: the stored [in, out] data is not the recorded [out, in] shape
        match = "weights.safetensors: tensor 'lin.weight' is (16, 24) torch.float32"
    else:
        match = "tensor 'lin.weight': dim_order must be a permutation of the recorded shape's dims"
    with pytest.raises(CheckpointError, match=re.escape(match)):
        ForgeGraph.from_checkpoint(ckpt)


def test_dim_order_must_match_the_stored_shape(pristine: tuple[ForgeGraph, Path], tmp_path: Path) -> None:
    """The identity order on the permuted buffer: the recorded shape in that order is not what is stored."""
    ckpt = fresh_copy(pristine[1], tmp_path)
    edit_json(ckpt, "graph.json", lambda doc: _entry(doc, "table").update(dim_order=[0, 1, 2]))
    with pytest.raises(CheckpointError, match=re.escape("tensor 'table': the stored tensor is (3, 24, 2); its recorded "
                                                        "shape (24, 2, 3) in dim_order [0, 1, 2] is (24, 2, 3)")):
        ForgeGraph.from_checkpoint(ckpt)
