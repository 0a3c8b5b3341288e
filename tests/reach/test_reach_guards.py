"""Shape guards on a real hierarchical vision model (minutes to export, so ``reach``-marked: ``make test-reach``;
tests/graph/test_guards.py keeps a small plain-torch model with the same window-padding guards in ``make test``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_archs import build, capture_inputs

from fxforge import ForgeGraph
from fxforge.graph.guards import ShapeGuardError

pytestmark = pytest.mark.reach


def test_swin_takes_every_batch_size_raw_export_proved(tmp_path: Path) -> None:
    """Swin's window padding makes torch.export guard sizes with long expressions (up to 5,000 characters, the
    same sub-expressions repeated): they are kept as checks, not pinned, so a capture at batch 2 runs other
    batch sizes exactly like eager and refuses the sides those guards exclude (torch.export's guards hold at
    32 x 32 only: HF Swin branches on whether a stage's resolution exceeds its window); reloaded too."""
    def inputs(batch: int, side: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(batch * 100 + side)
        return {"pixel_values": torch.randn(batch, 3, side, side, generator=gen)}

    model = build("swin")
    mg = ForgeGraph(model, example_inputs=capture_inputs("swin"), cache=False).eval()
    assert not [n for n in mg.capture_notes if "fixes" in n], mg.capture_notes
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "swin"))
    for graph in (mg, loaded):
        for batch in (3, 7):
            x = inputs(batch, 32)
            with torch.no_grad():
                assert torch.equal(graph(**x).logits, model(**x).logits), batch
        for side in (40, 24, 30):  # the second stage outgrows its window / fits it / not whole patches
            with pytest.raises(ShapeGuardError, match=rf"dimension \d is {side},"):
                graph(**inputs(3, side))
