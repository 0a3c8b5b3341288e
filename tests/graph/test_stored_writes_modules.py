"""A module call whose forward provably allocates (exactly ``nn.Linear`` or a convolution, not a subclass that may
override ``forward``) is fresh storage to the checkpoint's stored-writes rule, so an in-place activation on it is
no write to the weight it read (issue 27: Swinv2's continuous position bias MLP, ``Linear -> ReLU(inplace=True)``
over a stored coordinate table, refused to export). Any other module call still counts as aliasing its input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxforge import ForgeGraph
from fxforge.graph.targets import CheckpointError


class _TableBias(nn.Module):
    """A bias computed from a stored table by ``first -> ReLU(inplace=True) -> Linear``, as Swinv2 does."""

    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(5, 4))
        self.mlp = nn.Sequential(first, nn.ReLU(inplace=True), nn.Linear(4, 3, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.mlp(self.table.unsqueeze(0)).squeeze(0)  # (5, 3)
        return x @ bias


class _Conv1dBias(nn.Module):
    """The same over a convolution: ``Conv1d -> ReLU(inplace=True)`` on a stored table."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(1, 4, 5))
        self.conv = nn.Conv1d(4, 3, kernel_size=1)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.act(self.conv(self.table))[0].t()


class _SliceLinear(nn.Linear):
    """A Linear subclass whose forward hands back a view of its input: not provably fresh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., : self.out_features]


FRESH = {"linear": lambda: _TableBias(nn.Linear(4, 4)), "conv1d": _Conv1dBias}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("kind", sorted(FRESH))
def test_in_place_activation_on_a_module_result_round_trips(tmp_path: Path, frontend: str, kind: str) -> None:
    torch.manual_seed(0)
    model = FRESH[kind]().eval()
    table = model.table.clone()
    mg = ForgeGraph(model, example_inputs=(torch.randn(2, 5),), frontend=frontend)  # type: ignore[arg-type]
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt")).eval()
    stored = {k: v.clone() for k, v in back.model.state_dict().items()}  # fx folds the table into a constant
    for x in (torch.randn(2, 5), torch.randn(7, 5)):
        with torch.no_grad():
            assert torch.equal(back(x), model(x))
    assert all(torch.equal(v, stored[k]) for k, v in back.model.state_dict().items())
    assert torch.equal(model.table, table)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_in_place_activation_on_a_subclass_result_is_refused(tmp_path: Path, frontend: str) -> None:
    torch.manual_seed(0)
    model = _TableBias(_SliceLinear(4, 4)).eval()
    mg = ForgeGraph(model, example_inputs=(torch.randn(2, 5),), frontend=frontend)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"may share storage with the stored tensor"):
        mg.export(tmp_path / "ckpt")
