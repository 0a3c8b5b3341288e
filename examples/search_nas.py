"""MASE tutorial 5, as a library call: NAS over a small BERT's real config fields on IMDb.

    .venv/bin/python -m fxforge.examples.search_nas --trials 12
    (smoke test: --trials 2 --train-size 32 --eval-size 16 --max-length 16 --epochs 1 --sizes 16 --ffn-sizes 32)

Each trial builds a fresh BertForSequenceClassification from the sampled configuration (fields by
their real names: ``num_hidden_layers``, ``num_attention_heads``, ``hidden_size``,
``intermediate_size``), captures it, trains it briefly through ``get_trainer`` and measures accuracy;
impossible head splits are pruned before training, and the median pruner stops weak trials early.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from fxforge.examples.search_common import HF_NAMES  # noqa: E402
from fxforge.search import NASSpace, Search, TextClassificationTask  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--train-size", type=int, default=1000)
    p.add_argument("--eval-size", type=int, default=300)
    p.add_argument("--max-length", type=int, default=128, help="tokens kept per review")
    p.add_argument("--epochs", type=float, default=2.0, help="training epochs per trial")
    p.add_argument("--report-every", type=int, default=30, help="steps between accuracies fed to the pruner")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 192], help="hidden sizes to choose from")
    p.add_argument("--ffn-sizes", type=int, nargs="+", default=[128, 256, 512], help="FFN sizes to choose from")
    p.add_argument("--run-dir", default="out/search-nas")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    space = NASSpace("BertConfig", {"num_hidden_layers": [1, 2, 4], "num_attention_heads": [2, 4, 8],
                                    "hidden_size": args.sizes, "intermediate_size": args.ffn_sizes},
                     base={"vocab_size": 30522, "max_position_embeddings": args.max_length, "num_labels": 2})
    task = TextClassificationTask("imdb", train_size=args.train_size, eval_size=args.eval_size,
                                  max_length=args.max_length,
                                  train_args={"num_train_epochs": args.epochs, "learning_rate": 5e-4,
                                              "per_device_train_batch_size": 32}, report_every=args.report_every)
    run = Path(args.run_dir)
    result = Search(space, ["accuracy"], task=task, n_trials=args.trials, sampler="tpe", pruner="median",
                    capture={"hf_input_names": HF_NAMES}, run_dir=run, study_name="nas", resume=args.resume).run()
    print(result.table())
    best = result.study.best_trial
    print(f"best configuration {best.params}: accuracy {best.value:.3f}")
    result.plots(run / "plots")
    print(f"exported: {result.export(run / 'best', [best])[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
