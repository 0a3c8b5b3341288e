"""``fxforge inspect`` says which input dimensions a captured graph accepts at any size and which it fixed, and why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cli_support import run_cli
from conftest import make_agru, make_gpt, make_tiny_bert

from fxforge import ForgeGraph
from fxforge.cli.inspect_cmd import ensure_metadata, summary


def test_inspect_funnel_directory_names_the_static_length_and_why(tmp_path: Path) -> None:
    """A HF model directory as a user would have it: Funnel's length is fixed by its own code, not by fxforge."""
    import transformers

    torch.manual_seed(0)
    config = transformers.FunnelConfig(d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1],
                                       num_decoder_layers=1, vocab_size=100)
    transformers.FunnelModel(config).save_pretrained(tmp_path / "funnel")
    proc = run_cli("inspect", str(tmp_path / "funnel"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dynamic dims: input_ids[0], attention_mask[0] (= input_ids[0])\n" in out
    static = out[out.index("static dims:"):out.index("\n\n")]
    flat = " ".join(static.split())
    assert re.search(r"^static dims: input_ids\[1\]=16 because torch.export specialised input_ids dim 1 to 16: the "
                     r"model's code needs its value as a Python int .* at funnel/modeling_funnel.py:\d+ in "
                     r"get_position_embeds `pos = list\(range\(seq_len\)\)`", flat), static
    assert "attention_mask[1]=16 because torch.export specialised attention_mask dim 1 to 16: it is broadcast" in flat
    assert max(len(line) for line in out.splitlines()) <= 100 and "…" not in static  # wrapped, not cut


def test_inspect_bert_keeps_every_dim_dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # the summary wraps to the terminal: fix its width (make's may be 80)
    text = summary(ensure_metadata(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"])),
                   "tiny bert")
    assert "dynamic dims: input_ids[0], input_ids[1] in [2, 64], attention_mask[0], attention_mask[1] (= " \
           "input_ids[1])\n" in text
    assert "static dims:  none\n" in text


def test_inspect_fixed_shape_capture_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    text = summary(ensure_metadata(ForgeGraph(make_agru(), torch.randn(2, 12, 8), dynamic=False)), "agru", 0)
    assert "dynamic dims: none\n" in text
    assert "x[0]=2 because the graph was captured with dynamic=False for the example's size 2" in text
    assert "x[1]=12 because capture specialised this dimension to 12: a Python loop" in " ".join(text.split())


def test_inspect_fx_capture_records_no_guard() -> None:
    text = summary(ensure_metadata(ForgeGraph(make_gpt(), frontend="fx")), "gpt (fx)", 0)
    assert "dynamic dims: not checked (fx capture: torch.fx specialises no input size)" in text


def test_inspect_export_without_guard_says_nothing_is_checked() -> None:
    """An export capture that fixed nothing and proved no range has no guard: inspect says nothing is checked."""
    mg = ForgeGraph(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()), torch.randn(2, 3), frontend="export")
    assert mg(torch.randn(5, 7)).shape == (5, 7)  # other sizes run
    assert "dynamic dims: not checked (no shape guard in this graph" in summary(ensure_metadata(mg), "relu", 0)
