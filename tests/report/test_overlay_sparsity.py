"""The sparsity overlay shows what pruning removed, not what low-bit rounding zeroed: a quantized-only model
reloaded from its packed checkpoint (weights stored as their 4-bit values, 100% zeros on the zoo GPT at frac
width 2) shows no pruning sparsity, a pruned one its masks' fraction, live and reloaded; the weights that
quantize to 0 are their own overlay (``zero_codes``), the same live and reloaded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from conftest import make_gpt  # noqa: E402

QUANT = {"by": "type", "default": {"config": {"name": None}},
         "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                               "weight_width": 4, "weight_frac_width": 2, "bias_width": 8, "bias_frac_width": 4}}}
PRUNED = ["blocks.0.mlp.c_fc", "blocks.1.mixer.c_attn"]


@pytest.fixture(scope="module")
def gpt() -> Any:
    from fxforge import ForgeGraph, passes

    mg = ForgeGraph(make_gpt(), example_inputs=torch.randint(0, 64, (2, 8))).eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _values(mg: Any) -> dict[str, dict[str, float]]:
    """Overlay values per box id (nodes and groups) of the graph view."""
    from fxforge.report.hierarchy import build_hierarchy

    return {k: v.values for k, v in build_hierarchy(mg).items.items()}


def _linears(mg: Any) -> dict[str, str]:
    """Node name -> module path of every quantized linear."""
    from fxforge.passes.quantize.modules import QuantizedLinear

    return {n.name: str(n.target) for n in mg.nodes
            if n.op == "call_module" and isinstance(mg.model.get_submodule(str(n.target)), QuantizedLinear)}


def test_quantized_only_model_shows_no_pruning_sparsity(gpt: Any, tmp_path: Path) -> None:
    from fxforge import ForgeGraph, passes

    mg, _ = passes.quantize_transform_pass(gpt.copy(), QUANT)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "q"))
    live, back = _values(mg), _values(loaded)
    linears = _linears(loaded)
    assert len(linears) >= 8
    for name, path in linears.items():
        weight = loaded.model.get_submodule(path).weight
        assert float((weight == 0).float().mean()) > 0.8, "the stored 4-bit values are mostly 0 (rounding)"
        assert "sparsity" not in back[f"n:{name}"], name  # its float weight is not stored: no pruning figure
        assert live[f"n:{name}"]["sparsity"] == 0.0  # the live float weight has no zeros
        assert back[f"n:{name}"]["zero_codes"] == live[f"n:{name}"]["zero_codes"] > 0.8
    assert back["g:"]["sparsity"] < 0.05 and live["g:"]["sparsity"] < 0.05  # was 0.77 on tiny BERT reloaded


def test_pruned_model_shows_its_pruned_fraction(gpt: Any, tmp_path: Path) -> None:
    from fxforge import ForgeGraph, passes

    mg, _ = passes.prune_transform_pass(gpt.copy(), {"weight": {"sparsity": 0.5}, "targets": {"name": PRUNED}})
    mg, _ = passes.quantize_transform_pass(mg, QUANT)
    loaded = ForgeGraph.from_checkpoint(mg.export(tmp_path / "pq"))
    names = {path: name for name, path in _linears(mg).items()}
    for values in (_values(mg), _values(loaded)):
        for path in PRUNED:
            node = values[f"n:{names[path]}"]
            assert node["sparsity"] == 0.5  # the mask's fraction exactly, not the rounding zeros on top
            assert node["zero_codes"] > 0.8  # pruned and rounded-away weights together
        block = values["g:blocks.0"]
        mlp = gpt.model.get_submodule("blocks.0.mlp.c_fc").weight.numel()
        assert block["sparsity"] * block["sparsity_n"] == pytest.approx(0.5 * mlp, abs=1)
