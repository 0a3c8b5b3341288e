"""Inference peak memory before and after buffer_reuse_transform_pass (issue 31, item 2), measured and estimated.

    .venv/bin/python -m fxforge.benchmarks.bench_buffer_reuse            # tiny BERT 8x128, zoo GPT T=1024 batch 4
    .venv/bin/python -m fxforge.benchmarks.bench_buffer_reuse --quick    # the unit tests' tiny models, seconds

*Measured*: the CPU allocator's peak during one eval forward without grad (passes/analysis/liveness's
measured_peak_bytes: torch.profiler's memory events), median of interleaved repeats (original, rewritten,
original, ...). *Estimated*: the liveness analysis's inference peak (live activation bytes at the worst node).
Outputs are checked bit for bit (torch.equal) on the measured inputs. Nothing is timed.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from fxforge import ForgeGraph, passes  # noqa: E402
from fxforge.models.bert import tiny_bert  # noqa: E402
from fxforge.models.gpt import GPT, GPTConfig  # noqa: E402
from fxforge.passes.analysis.liveness import measured_peak_bytes  # noqa: E402
from fxforge.passes.propagate import flat_inputs  # noqa: E402

KB = 1024


def models(quick: bool) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, captured graph, keyword inputs) for tiny BERT and the zoo GPT."""
    torch.manual_seed(0)
    batch, seq = (2, 16) if quick else (8, 128)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (batch, seq), generator=gen)
    bert_in = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    bert = tiny_bert(num_labels=2, vocab_size=100, num_attention_heads=4, max_position_embeddings=max(64, seq)).eval()
    cfg = (GPTConfig(vocab_size=64, sequence_length=32, n_layer=2, n_head=2, n_embd=32) if quick
           else GPTConfig(vocab_size=256, sequence_length=1024))
    gpt_batch = 2 if quick else 4
    idx = torch.randint(0, cfg.vocab_size, (gpt_batch, cfg.sequence_length), generator=gen)
    return [
        (f"tiny BERT {batch}x{seq}", ForgeGraph(bert, example_inputs=bert_in,
                                               hf_input_names=["input_ids", "attention_mask"]), bert_in),
        (f"GPT {cfg.n_layer}x{cfg.n_embd} T={cfg.sequence_length} batch {gpt_batch}",
         ForgeGraph(GPT(cfg).eval(), example_inputs=(idx,)), {"idx": idx}),
    ]


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models (seconds)")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    print(f"{'model':34} {'measured before':>15} {'after':>9} {'ratio':>6} {'estimate before':>15} {'after':>9}"
          f" {'rewrites':>8} {'equal':>5}")
    for name, mg, inputs in models(opts.quick):
        new, info = passes.buffer_reuse_transform_pass(mg, {"data": inputs})
        flat = flat_inputs(mg.model, mg.example_inputs.coerce(inputs))
        before, after = [], []
        for _ in range(opts.repeats):
            before.append(measured_peak_bytes(mg.model, flat, training=False))
            after.append(measured_peak_bytes(new.model, flat, training=False))
        with torch.no_grad():
            equal = torch.equal(_logits(mg(**inputs)), _logits(new(**inputs)))
        b, a = statistics.median(before), statistics.median(after)
        print(f"{name:34} {b / KB:13.0f}KB {a / KB:7.0f}KB {a / b:6.2f} {info.peak_before_bytes / KB:13.0f}KB "
              f"{info.peak_after_bytes / KB:7.0f}KB {len(info.rewrites):8d} {str(equal):>5}")


if __name__ == "__main__":
    main()
