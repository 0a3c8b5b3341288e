"""MASE's attention swap on fxforge: a trained GPT's multi-head attention -> grouped-query attention, and back.

1. Train the zoo GPT (2 layers, 4 heads, width 64) on a second-order Markov language (each token depends on
   the two before it, so each position needs two different looks back: two kinds of head).
2. Capture it and run ``attention_swap_transform_pass`` with ``kv_heads`` 1 (multi-query): the pass reports
   the cost (relative output error, SQNR, parameters removed); the held-out loss shows it.
3. Fine-tune the converted graph for a few steps: the loss comes back towards the trained model's.

``python -m fxforge.examples.attention_swap [--quick]`` (``--quick``: fewer steps, ~half a minute).
"""

from __future__ import annotations

import argparse
import time

import torch

from fxforge.examples.story import Story
from fxforge.graph.forge_graph import ForgeGraph
from fxforge.models.gpt import GPT, GPTConfig, lm_loss
from fxforge.passes.analysis.metadata import add_common_metadata_analysis_pass
from fxforge.passes.transform.attention_swap import attention_swap_transform_pass

VOCAB, LENGTH = 16, 32


def markov_language(seed: int = 0) -> torch.Tensor:
    """Next-token probabilities given the two previous tokens, ``(VOCAB, VOCAB, VOCAB)``: two likely tokens each."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, VOCAB, generator=gen) * 0.5
    top = torch.randint(0, VOCAB, (VOCAB, VOCAB, 2), generator=gen)
    logits.scatter_add_(2, top, torch.full(top.shape, 4.0))
    return logits.softmax(-1)


def sample(table: torch.Tensor, batch: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` sequences of LENGTH + 1 tokens drawn from the language."""
    seq = torch.randint(0, VOCAB, (batch, 2), generator=gen)
    for _ in range(LENGTH - 1):
        probs = table[seq[:, -2], seq[:, -1]]
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], 1)
    return seq


def loss_of(model: torch.nn.Module, data: torch.Tensor) -> float:
    with torch.no_grad():
        was = model.training
        model.eval()
        loss = float(lm_loss(model(data[:, :-1]), data[:, 1:]))
        model.train(was)
    return loss


def train(model: torch.nn.Module, table: torch.Tensor, steps: int, lr: float, seed: int) -> None:
    """AdamW on fresh batches of 32 sequences."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = sample(table, 32, gen)
        loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer training steps (the test's setting)")
    parser.add_argument("--kv-heads", type=int, default=1)
    args = parser.parse_args(argv)
    train_steps, tune_steps = (300, 60) if args.quick else (1200, 200)
    torch.manual_seed(0)
    story = Story(3)
    table = markov_language()
    held_out = sample(table, 256, torch.Generator().manual_seed(99))

    story.step(f"train the zoo GPT on a second-order Markov language ({train_steps} steps)")
    t0 = time.perf_counter()
    model = GPT(GPTConfig(vocab_size=VOCAB, sequence_length=LENGTH, n_layer=2, n_head=4, n_embd=64))
    train(model, table, train_steps, 3e-3, seed=1)
    trained = loss_of(model, held_out)
    story.say(f"held-out loss {trained:.3f} ({time.perf_counter() - t0:.0f}s)")

    story.step(f"attention_swap_transform_pass: 4 heads -> kv_heads {args.kv_heads}")
    mg = ForgeGraph(model, example_inputs=held_out[:2, :-1])
    mg, _ = add_common_metadata_analysis_pass(mg)
    gqa, info = attention_swap_transform_pass(mg, {"kv_heads": args.kv_heads, "data": [(held_out[:64, :-1],)]})
    swapped = loss_of(gqa.model, held_out)
    story.say(f"{len(info.layers)} layers converted, {info.parameters_removed} parameters removed; reported cost: "
              f"relative output error {info.relative_output_error:.3f}, SQNR {info.output_sqnr_db:.1f} dB")
    story.say(f"held-out loss {trained:.3f} -> {swapped:.3f}")
    story.check(swapped > trained, "the swap costs loss (heads were pooled)")

    story.step(f"fine-tune the grouped-query graph ({tune_steps} steps)")
    train(gqa.model, table, tune_steps, 1e-3, seed=2)
    tuned = loss_of(gqa.model, held_out)
    recovered = (swapped - tuned) / (swapped - trained) if swapped > trained else 0.0
    story.say(f"held-out loss {swapped:.3f} -> {tuned:.3f} (trained model: {trained:.3f}; "
              f"{100 * recovered:.0f}% of the cost recovered)")
    story.check(tuned < swapped, "fine-tuning recovers part of the cost")
    return story.end("attention swap")


if __name__ == "__main__":
    raise SystemExit(main())
