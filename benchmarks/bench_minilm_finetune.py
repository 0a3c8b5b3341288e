"""Fine-tune the offline MiniLM on IMDb through ``get_trainer`` and report held-out accuracy and wall time.

Run: ``python -m fxforge.benchmarks.bench_minilm_finetune`` (several minutes on 2 CPU cores). Defaults:
2,000 training reviews, 1 epoch, max_length 128, evaluated on 1,000 reviews of the fixed test split.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from ..data import get_tokenized_dataset, get_trainer  # noqa: E402
from ..models.bert import MINILM_NAME, load_sequence_classifier  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the fine-tuning benchmark and print/return its numbers."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", default=MINILM_NAME)
    p.add_argument("--train_reviews", type=int, default=2000)
    p.add_argument("--test_reviews", type=int, default=1000)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    ds, tok = get_tokenized_dataset("imdb", checkpoint=args.checkpoint, return_tokenizer=True,
                                    max_length=args.max_length, limit=args.train_reviews,
                                    test_limit=args.test_reviews)
    model = load_sequence_classifier(args.checkpoint, num_labels=2)
    t_data = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = get_trainer(
            model, ds, tok, output_dir=out_dir, num_train_epochs=args.epochs, learning_rate=args.lr,
            per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64, seed=args.seed,
            training_args={"warmup_steps": 0.1, "eval_strategy": "no", "disable_tqdm": True, "logging_steps": 25},
        )
        t1 = time.perf_counter()
        trainer.train()
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        metrics = trainer.evaluate()
        t_eval = time.perf_counter() - t2
    total = time.perf_counter() - t0
    result = {"accuracy": metrics["eval_accuracy"], "train_s": t_train, "eval_s": t_eval, "load_s": t_data,
              "total_s": total}
    print(f"MiniLM-L6 fine-tune: {len(ds['train'])} train / {len(ds['test'])} test reviews, "
          f"max_length {args.max_length}, {args.epochs:g} epoch(s), batch {args.batch_size}, lr {args.lr:g}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"held-out accuracy {result['accuracy']:.4f}  eval loss {metrics['eval_loss']:.4f}")
    print(f"wall time: load {t_data:.1f}s, train {t_train:.1f}s, eval {t_eval:.1f}s, total {total:.1f}s")
    return result


if __name__ == "__main__":
    main()
