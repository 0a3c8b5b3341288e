"""MASE tutorial 4 on fxforge: prune a MiniLM IMDb classifier, element-wise and structurally.

1. Fine-tune MiniLM-L6 (offline package) on ``--train`` IMDb reviews (length 128) once; cached (or
   ``--base CHECKPOINT``: an fxforge checkpoint of the fine-tuned classifier, e.g. the search example's).
2. Global L1 at 50 % element-wise (MASE's tutorial config): accuracy before, right after pruning, and
   after one short fine-tune (``--ft-train`` reviews, one epoch, masks kept by the HF Trainer).
3. Structured: 50 % of the FFN units and a third of the heads of every layer (``--method`` l1, or taylor
   on ``--calib`` training batches), shrunk to smaller dense layers; accuracy right after and after the
   same short fine-tune (``--distill ALPHA``: distilled from the unpruned model).
4. Torch-Pruning (DepGraph, PyPI ``torch-pruning``) at the same target with the same criterion (L1 magnitude
   or its group Taylor importance), same fine-tune (``--no-tp`` skips).
5. Control (row ``dense``): the unpruned model given the same short fine-tune.
Prints the table next to the logbook's 84 / 55 / 83 %. Speed: ``benchmarks/bench_prune.py``.
(Smoke test: ``--train 16 --ft-train 16 --test 16 --length 16 --epochs 1 --rows elementwise,structured``.)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from fxforge.benchmarks.prune_recipes import ELEMENTWISE, FFN, HEADS, torch_pruning_model  # noqa: E402
from fxforge.data import get_tokenized_dataset, get_trainer  # noqa: E402
from fxforge.examples.quantization import accuracy, batches  # noqa: E402
from fxforge.graph.forge_graph import ForgeGraph  # noqa: E402
from fxforge.passes.prune import prune_transform_pass, shrink_transform_pass  # noqa: E402

INPUTS = ["input_ids", "attention_mask", "labels"]
LOGBOOK = (0.84, 0.55, 0.83)


def base_model(args: argparse.Namespace, ds: Any, tokenizer: Any) -> torch.nn.Module:
    """The fine-tuned fp32 classifier, from the cache or trained now."""
    from transformers import AutoModelForSequenceClassification

    from fxforge.models.bert import minilm_for_sequence_classification

    if args.base is not None:  # an fxforge checkpoint of the same classifier (e.g. the search example's)
        model = minilm_for_sequence_classification()
        missing, unexpected = model.load_state_dict(ForgeGraph.from_checkpoint(args.base).model.state_dict(),
                                                    strict=False)
        if missing or any(not k.endswith(("position_ids", "token_type_ids")) for k in unexpected):
            raise SystemExit(f"--base {args.base}: not a MiniLM classifier (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        return model.eval()
    cache = Path(args.cache_dir) / f"minilm-imdb-{args.train}-{args.length}"
    if (cache / "config.json").is_file():
        return AutoModelForSequenceClassification.from_pretrained(str(cache)).eval()
    torch.manual_seed(0)
    model = minilm_for_sequence_classification()
    get_trainer(model, ds, tokenizer, output_dir=str(Path(args.cache_dir) / "trainer"), num_train_epochs=args.epochs,
                learning_rate=1e-4, per_device_train_batch_size=16,
                training_args={"eval_strategy": "no", "save_strategy": "no"}).train()
    model.save_pretrained(str(cache))
    return model.eval()


def short_finetune(model: torch.nn.Module, args: argparse.Namespace, ds: Any, tokenizer: Any,
                   teacher: ForgeGraph | None = None) -> float:
    """``--ft-epochs`` on the first ``--ft-train`` reviews at ``--ft-lr``; returns the seconds it took."""
    subset = {"train": torch.utils.data.Subset(ds["train"], range(min(args.ft_train, len(ds["train"])))),
              "test": ds["test"]}
    start = time.time()
    torch.manual_seed(0)
    get_trainer(model, subset, tokenizer, output_dir=str(Path(args.cache_dir) / "ft"),
                num_train_epochs=args.ft_epochs, learning_rate=args.ft_lr, per_device_train_batch_size=16,
                teacher=teacher if args.distill is not None else None,
                distill=None if args.distill is None else {"alpha": args.distill, "temperature": 2.0},
                training_args={"eval_strategy": "no", "save_strategy": "no"}).train()
    model.eval()
    return time.time() - start


class _Rows(list):
    """Table rows, each printed as soon as it is measured (a long run keeps what it measured)."""

    def append(self, row: tuple[str, float, float, float, str]) -> None:
        name, b, a, f, note = row
        print(f"{name:<72} {b:>7.3f} {a:>7.3f} {f:>7.3f}  {note}", flush=True)
        super().append(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="MiniLM IMDb pruning table (MASE tutorial 4)")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--ft-train", type=int, default=400)
    parser.add_argument("--ft-epochs", type=float, default=1.0, help="epochs of the short fine-tune")
    parser.add_argument("--ft-lr", type=float, default=5e-5, help="learning rate of the short fine-tune")
    parser.add_argument("--test", type=int, default=400)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--no-tp", action="store_true")
    parser.add_argument("--distill", type=float, default=None, metavar="ALPHA",
                        help="distil the short fine-tune from the unpruned model (loss: ALPHA * CE + (1 - ALPHA) * KL)")
    parser.add_argument("--rows", default="elementwise,structured,tp,dense",
                        help="rows to measure: elementwise, structured, tp (Torch-Pruning), dense (control)")
    parser.add_argument("--method", default="l1", choices=("l1", "taylor"),
                        help="structured criterion: l1, or taylor (loss-change estimate per head / FFN unit)")
    parser.add_argument("--calib", type=int, default=40, help="calibration batches (of 16 reviews) for taylor")
    parser.add_argument("--base", default=None, help="fxforge checkpoint of the fine-tuned classifier to prune "
                        "(default: fine-tune on --train reviews, cached)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fxforge" / "prune-example"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    full, tokenizer = get_tokenized_dataset("imdb", checkpoint="minilm", return_tokenizer=True,
                                            max_length=args.length, limit=args.train, test_limit=args.test)
    ds = {"train": full["train"], "test": full["test"]}
    test = batches(ds["test"], tokenizer, 32)
    model = base_model(args, ds, tokenizer)
    base = ForgeGraph(model, hf_input_names=INPUTS).eval()
    before = accuracy(base, test)
    print(f"\nMiniLM IMDb, {args.train} train / {args.test} test reviews, length {args.length}, short fine-tune on "
          f"{args.ft_train} reviews ({args.ft_epochs:g} epoch(s), lr {args.ft_lr:g}"
          f"{'' if args.distill is None else f', distilled from the unpruned model, alpha {args.distill:g}'})")
    print(f"{'method':<72} {'before':>7} {'pruned':>7} {'+ft':>7}")
    print(f"{'logbook (MASE tutorial 4)':<72} {LOGBOOK[0]:>7.3f} {LOGBOOK[1]:>7.3f} {LOGBOOK[2]:>7.3f}")
    rows = _Rows()

    rows_wanted = set(args.rows.split(","))
    calib = batches(ds["train"], tokenizer, 16, limit=16 * args.calib) if args.method == "taylor" else None
    if "elementwise" in rows_wanted:
        elementwise_row(base, before, args, ds, tokenizer, test, rows)
    if "structured" in rows_wanted:
        extra: dict[str, Any] = {} if calib is None else {"data": calib, "num_batches": len(calib)}
        ffn, heads = ({**cfg, "weight": {**cfg["weight"], "method": args.method}, **extra} for cfg in (FFN, HEADS))
        mg, _ = prune_transform_pass(base.copy(), ffn)
        mg, _ = prune_transform_pass(mg, heads)
        right_after = accuracy(mg, test)
        small, sinfo = shrink_transform_pass(mg)
        secs = short_finetune(small.model, args, ds, tokenizer, base)
        ratio = sinfo.params_after / sinfo.params_before
        rows.append((f"fxforge {args.method} 50% FFN + 1/3 heads, shrunk ({ratio:.2f}x params)", before,
                     right_after, accuracy(small, test), f"ft {secs:.0f} s"))
    if "tp" in rows_wanted and not args.no_tp:
        tp_model = torch_pruning_model(base_model(args, ds, tokenizer),
                                       {k: v[:2] for k, v in test[0].items() if k != "labels"}, calib)
        right_after = accuracy(tp_model, test)
        secs = short_finetune(tp_model, args, ds, tokenizer, base)
        params = sum(p.numel() for p in tp_model.parameters())
        dense = sum(p.numel() for p in base.model.parameters())
        rows.append((f"Torch-Pruning {args.method} same target ({params / dense:.2f}x params)", before,
                     right_after, accuracy(tp_model, test), f"ft {secs:.0f} s"))
    if "dense" in rows_wanted:  # control: the unpruned model given the same extra fine-tune
        dense_model = base_model(args, ds, tokenizer)
        secs = short_finetune(dense_model, args, ds, tokenizer, base)
        rows.append(("unpruned, same short fine-tune (control)", before, before, accuracy(dense_model, test),
                     f"ft {secs:.0f} s"))
    print(f"load average {os.getloadavg()[0]:.1f}")


def elementwise_row(base: ForgeGraph, before: float, args: argparse.Namespace, ds: Any, tokenizer: Any,
                    test: Any, rows: _Rows) -> None:
    """Global L1 at 50 % element-wise: accuracy right after and after the short fine-tune (masks kept)."""
    mg, info = prune_transform_pass(base.copy(), ELEMENTWISE)
    right_after = accuracy(mg, test)
    secs = short_finetune(mg.model, args, ds, tokenizer, base)
    zeros = all(bool((m.weight[~m.weight_mask] == 0).all()) for m in mg.model.modules() if hasattr(m, "weight_mask"))
    rows.append((f"fxforge global L1 50% element-wise (sparsity {info.sparsity:.3f})", before, right_after,
                 accuracy(mg, test), f"ft {secs:.0f} s, masked weights still zero: {zeros}"))


if __name__ == "__main__":
    main()
