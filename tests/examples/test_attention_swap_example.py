"""examples/attention_swap.py --quick: a trained GPT converted to multi-query attention loses held-out loss, and a
short fine-tune of the converted graph wins part of it back (the numbers printed are the ones measured)."""

from __future__ import annotations

import re

import pytest


@pytest.mark.slow  # trains a GPT: ~half a minute on a quiet core
def test_swap_costs_loss_and_fine_tuning_recovers(capsys: pytest.CaptureFixture[str]) -> None:
    from fxforge.examples.attention_swap import main

    code = main(["--quick"])
    text = capsys.readouterr().out
    assert code == 0, text
    trained, swapped = map(float, re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+)\n", text).groups())  # type: ignore[union-attr]
    again, tuned, trained_again = map(float, re.search(  # type: ignore[union-attr]
        r"held-out loss ([0-9.]+) -> ([0-9.]+) \(trained model: ([0-9.]+);", text).groups())
    assert swapped > trained and tuned < swapped and (again, trained_again) == (swapped, trained)
    error = float(re.search(r"relative output error ([0-9.]+)", text).group(1))  # type: ignore[union-attr]
    assert 0 < error < 10 and "2 layers converted" in text
