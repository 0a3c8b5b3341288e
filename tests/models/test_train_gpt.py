"""The GPT training script: a few steps on IMDb bytes for each mixer, through its CLI parser."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fxforge.models.train_gpt import build_parser, encode_reviews, get_batch, lr_at, main

TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--sequence_length", "32", "--batch_size", "4",
        "--steps", "6", "--eval_interval", "3", "--eval_iters", "2", "--log_interval", "2",
        "--max_reviews", "50", "--warmup_steps", "2", "--afno_num_blocks", "4", "--lr", "1e-2"]


@pytest.mark.parametrize("mixer", ["attn", "afno"])
def test_training_runs_and_reports(mixer: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = main([*TINY, "--mixer", mixer, "--bias"])
    out = capsys.readouterr().out
    assert "tok/s" in out and "val loss" in out and "step time" in out
    assert math.isfinite(result.final_train_loss) and math.isfinite(result.final_val_loss)
    # the untrained model's loss (step 1, logged before its update) is ~log(256); training must beat it
    first = float(re.search(r"step\s+1/\d+\s+train loss ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert abs(first - math.log(256)) < 0.3
    assert result.final_train_loss < first - 0.3 and result.final_val_loss < math.log(256) - 0.3
    assert result.tokens_per_second > 0 and result.parameters > 0


def test_cli_defaults_mirror_the_changelog() -> None:
    args = build_parser().parse_args(["--mixer", "afno"])
    assert args.mixer == "afno" and args.bias is False and args.afno_causality == "causal"
    for flag in ("afno_num_blocks", "afno_sparsity_threshold", "afno_hard_thresholding_fraction",
                 "afno_hidden_size_factor", "sequence_length", "batch_size", "n_layer", "n_head", "n_embd",
                 "steps", "lr"):
        assert hasattr(args, flag), flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--mixer", "lstm"])


def test_byte_batches_and_schedule() -> None:
    data = encode_reviews(["ab<br />c", "dé"])
    assert bytes(data.tolist()) == "ab\nc\n\ndé".encode()
    x, y = get_batch(data, 3, 4, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 4) and x.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="too short"):
        get_batch(data, 1, 64, torch.Generator())
    assert lr_at(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
