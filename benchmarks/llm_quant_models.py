"""The two models bench_llm_quant quantizes, with their calibration and held-out data.

* The zoo GPT (models/gpt.py) trained by ``models.train_gpt`` on the offline IMDb review text (byte level),
  cached as a state dict in the run directory; measured by perplexity on held-out windows of the test split,
  calibrated on windows of the training split.
* MiniLM fine-tuned on IMDb (``benchmarks.minilm_imdb``: the project's own fine-tune, cached as a checkpoint);
  measured by accuracy on held-out test reviews, calibrated on training reviews (``Task.calibration``); and,
  beside it, by the mean cross-entropy on the same reviews (``paired``): a continuous metric of every review,
  so the difference between two methods is not lost in how few reviews flip their argmax.

``quick`` swaps both for tiny models trained for seconds (a smoke run: the numbers mean nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..graph.forge_graph import ForgeGraph

__all__ = ["Subject", "gpt_subject", "minilm_subject", "GPT_TARGETS", "BERT_TARGETS"]

# The linears inside the transformer blocks (full-match regexes on module paths): what GPTQ / AWQ quantize in
# LLMs. Embeddings, norms, the LM head and the classifier / pooler stay fp32.
GPT_TARGETS = r"blocks\.\d+\.(mixer|mlp)\.c_(attn|proj|fc)"
BERT_TARGETS = r"(.*\.)?encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|" \
               r"intermediate\.dense|output\.dense)"
CALIB_BATCH = 16


@dataclass
class Subject:
    """One model under test: its fp32 graph, calibration batches (training split), held-out metric."""

    name: str
    metric: str
    higher_is_better: bool
    graph: ForgeGraph
    calib: list[Any]
    evaluate: Callable[[ForgeGraph], float]
    targets: str
    rotate_args: dict[str, Any]
    setup: dict[str, Any] = field(default_factory=dict)  # sizes and sources, printed and written to the JSON
    # a second metric of the same held-out samples (name, higher is better?, function), printed beside the first
    paired: tuple[str, bool, Callable[[ForgeGraph], float]] | None = None


TINY_GPT = ["--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--sequence_length", "64", "--batch_size", "8"]


def _gpt_args(quick: bool, steps: int | None, seed: int, tiny: bool = False) -> Any:
    from ..models.train_gpt import build_parser

    size = [*TINY_GPT, "--max_reviews", "400"] if quick else TINY_GPT if tiny else []
    n = steps if steps is not None else (40 if quick else 600)
    log = str(max(1, n // 4))
    return build_parser().parse_args([*size, "--steps", str(n), "--warmup_steps", str(max(1, n // 10)),
                                      "--eval_interval", log, "--log_interval", log, "--seed", str(seed)])


def trained_gpt(run_dir: Path, quick: bool, steps: int | None = None, seed: int = 0,
                tiny: bool = False) -> tuple[Any, dict[str, Any]]:
    """The zoo GPT trained by ``train_gpt`` with the benchmark's settings (cached per setting in ``run_dir``);
    ``tiny``: the quick run's 2-layer, 64-wide architecture (trained on all reviews, for ``steps``)."""
    from ..models.gpt import GPT, GPTConfig
    from ..models.train_gpt import train

    args = _gpt_args(quick, steps, seed, tiny)
    tag = f"gpt-{'q' if quick else ''}L{args.n_layer}-D{args.n_embd}-T{args.sequence_length}-S{args.steps}" \
          f"-seed{seed}.pt"  # quick trains on 400 reviews only: its own file
    path = run_dir / tag
    if path.exists():
        saved = torch.load(path, weights_only=False)
        model = GPT(GPTConfig(**saved["config"]))
        model.load_state_dict(saved["state_dict"])
        print(f"reusing the trained GPT at {path}")
        return model.eval(), saved["train"]
    print(f"training the zoo GPT ({args.steps} steps; cached at {path})")
    result = train(args)
    assert result.model is not None
    info = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "train_seconds": result.seconds,
            "final_val_loss": result.final_val_loss, "parameters": result.parameters}
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"config": asdict(result.model.config), "state_dict": result.model.state_dict(), "train": info},
               path)
    return result.model.eval(), info


def gpt_subject(run_dir: Path, quick: bool, calib_seqs: int, eval_windows: int, steps: int | None = None,
                seed: int = 0, tiny: bool = False) -> Subject:
    """The trained GPT; perplexity on ``eval_windows`` evenly spread windows of the held-out reviews' text."""
    from ..models.gpt import lm_loss
    from ..models.train_gpt import encode_reviews, get_batch
    from ..reviews import load_reviews

    model, train_info = trained_gpt(run_dir, quick, steps, seed, tiny)
    seq = model.config.sequence_length
    reviews = load_reviews("imdb")
    train_text = encode_reviews([r.text for r in reviews["train"]])
    held_text = encode_reviews([r.text for r in reviews["test"]])
    x, _ = get_batch(train_text, calib_seqs, seq, torch.Generator().manual_seed(seed + 1))
    calib = [(chunk,) for chunk in x.split(CALIB_BATCH)]
    starts = torch.linspace(0, held_text.numel() - seq - 2, eval_windows).long()
    windows = torch.stack([held_text[s:s + seq + 1] for s in starts.tolist()]).long()
    held = list(zip(windows[:, :-1].split(32), windows[:, 1:].split(32)))

    def perplexity(graph: ForgeGraph) -> float:
        graph.model.eval()
        with torch.no_grad():
            total = sum(lm_loss(graph(xb), yb).item() * xb.numel() for xb, yb in held)
        return math.exp(total / (windows.numel() - windows.shape[0]))

    graph = ForgeGraph(model, (calib[0][0],)).eval()
    setup = {"model": f"zoo GPT {model.config.n_layer} layers, width {model.config.n_embd}, byte vocabulary",
             "train": train_info, "calibration": f"{calib_seqs} windows of {seq} bytes, training split",
             "evaluation": f"{eval_windows} windows of {seq} bytes, test split (held out)"}
    rotate = {"mode": "layernorm"}  # pre-LN: LayerNorms folded, the residual stream rotated, fused into weights
    return Subject("zoo GPT", "val perplexity", False, graph, calib, perplexity, GPT_TARGETS, rotate, setup)


def minilm_subject(run_dir: Path, quick: bool, calib_seqs: int, eval_reviews: int, train_reviews: int,
                   max_length: int = 128, epochs: float = 1.0, lr: float = 5e-5) -> Subject:
    """MiniLM fine-tuned on IMDb (tiny BERT trained for a few steps with ``quick``); accuracy on held-out reviews."""
    from .minilm_imdb import HF_NAMES, finetuned_minilm, imdb_task

    if quick:
        from ..models.bert import tiny_bert

        task = imdb_task(train_reviews, eval_reviews, max_length=32, lr=1e-3)
        task.progress = False
        graph = ForgeGraph(tiny_bert(intermediate_size=64, max_position_embeddings=64).eval(),
                           hf_input_names=HF_NAMES)
        task.train(graph, None, steps=max(1, train_reviews // 16))
        name = "tiny BERT (quick)"
    else:
        task = imdb_task(train_reviews, eval_reviews, max_length=max_length, epochs=epochs, lr=lr)
        graph = finetuned_minilm(run_dir, task)
        name = "MiniLM"
    calib_batches, _ = task.calibration(graph.model)
    calib, seen = [], 0
    for batch in calib_batches:
        if seen >= calib_seqs:
            break
        calib.append(batch)
        seen += int(batch["input_ids"].shape[0])
    setup = {"model": f"{name} fine-tuned on IMDb ({train_reviews} training reviews unless a cached checkpoint in "
                      f"the run directory is reused), max_length {task.max_length}",
             "calibration": f"{seen} training reviews", "evaluation": f"{eval_reviews} test reviews (held out)"}
    # post-LN BERT: no fused rotation exists, so each block linear gets an online rotation (x·H at run time)
    rotate = {"mode": "online", "targets": {"regex": [BERT_TARGETS]}}
    held_out = HeldOut(task)
    return Subject(name, "accuracy", True, graph.eval(), calib, held_out.accuracy, BERT_TARGETS, rotate, setup,
                   ("held-out loss", False, held_out.loss))


class HeldOut:
    """Accuracy and mean cross-entropy of the true label over a task's held-out samples, from one pass over
    them (eval mode, no grad): the second metric asked for the same graph is the one the first pass kept."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self._last: tuple[ForgeGraph, float, float] | None = None

    def measure(self, graph: ForgeGraph) -> tuple[float, float]:
        """(accuracy, mean loss) of ``graph``, measured now from the task's one pass over its held-out data."""
        import torch.nn.functional as F

        pairs = self.task.held_out_logits(graph)
        count = sum(int(labels.numel()) for _, labels in pairs)
        correct = sum(int((logits.argmax(-1) == labels).sum()) for logits, labels in pairs)
        total = sum(float(F.cross_entropy(logits, labels, reduction="sum")) for logits, labels in pairs)
        self._last = (graph, correct / count, total / count)
        return correct / count, total / count

    def _kept(self, graph: ForgeGraph) -> tuple[float, float]:
        last = self._last
        return (last[1], last[2]) if last is not None and last[0] is graph else self.measure(graph)

    def accuracy(self, graph: ForgeGraph) -> float:
        return self.measure(graph)[0]

    def loss(self, graph: ForgeGraph) -> float:
        return self._kept(graph)[1]
