"""What a trial is evaluated on: held-out batches with labels, and (when the space needs it) training.

:class:`TextClassificationTask` wraps fxforge's offline IMDb / Rotten Tomatoes data and trains through
``fxforge.data.get_trainer`` (the HF Trainer), reporting intermediate accuracy to the trial so Optuna's
pruners (median, hyperband) can stop hopeless trials early. Batches are data: built once per process
and passed by reference.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import SearchError
from .progress import search_bar_shown

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph

__all__ = ["Batch", "Task", "TensorTask", "TextClassificationTask", "logits_of"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # (model keyword inputs, labels)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (HF ModelOutput, dict, tuple or tensor)."""
    from ..distill import logits_of as find

    try:
        return find(output)
    except TypeError as exc:
        raise SearchError(str(exc)) from None


def with_labels(model: torch.nn.Module, inputs: Mapping[str, Any], labels: torch.Tensor) -> dict[str, Any]:
    """``inputs`` plus ``labels`` when the model's forward takes them (a graph captured with labels needs them)."""
    from ..data import _accepted_keys

    keys = _accepted_keys(model)
    return {**inputs, "labels": labels} if keys is not None and "labels" in keys else dict(inputs)


class Task(ABC):
    """Evaluation data (and optionally training) for a search."""

    @abstractmethod
    def eval_batches(self) -> Sequence[Batch]:
        """Held-out (inputs, labels) batches; the same objects on every call."""

    def train(self, graph: ForgeGraph, trial: optuna.Trial | None, steps: int | None = None,
              checkpoints: Sequence[int] = (), on_checkpoint: Callable[[int], None] | None = None) -> None:
        """Fine-tune ``graph`` in place; report intermediate accuracy to ``trial`` for pruners. ``steps``
        replaces the task's own number of optimizer steps, and ``on_checkpoint(step)`` is called after each
        step in ``checkpoints`` (a fidelity's rungs: it measures, reports, and may raise TrialPruned)."""
        raise SearchError(f"{type(self).__name__} cannot train; use a space that needs no fine-tuning")

    def calibration_batches(self) -> Sequence[Batch]:
        """(inputs, labels) batches for data-driven passes (taylor pruning), never the held-out ones."""
        raise SearchError(f"{type(self).__name__} has no calibration data (needed by pruning method 'taylor')")

    def calibration(self, model: torch.nn.Module) -> tuple[list[dict[str, Any]], Any]:
        """Calibration batches as ``model``'s keyword inputs and a cross-entropy ``loss_fn(output, batch)``,
        the shape ``prune_transform_pass`` takes as ``data`` / ``loss_fn``."""
        import torch.nn.functional as F

        batches = list(self.calibration_batches())
        if not batches:
            raise SearchError(f"{type(self).__name__}: the calibration data is empty")
        data = [with_labels(model, inputs, labels) for inputs, labels in batches]
        labels_of = {id(d): labels for d, (_, labels) in zip(data, batches)}

        def loss_fn(output: Any, batch: Any) -> torch.Tensor:
            return F.cross_entropy(logits_of(output).float(), labels_of[id(batch)])

        return data, loss_fn

    def held_out_logits(self, graph: ForgeGraph) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(float logits, labels) of every held-out batch, from one pass in eval mode without grad: what the
        accuracy (and a benchmark's held-out loss) is computed from."""
        model = graph.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                pairs = [(logits_of(model(**with_labels(model, inputs, labels))).float(), labels)
                         for inputs, labels in self.eval_batches()]
        finally:
            model.train(was_training)
        if sum(int(labels.numel()) for _, labels in pairs) == 0:
            raise SearchError("the task's evaluation data is empty")
        return pairs

    def accuracy(self, graph: ForgeGraph) -> float:
        """Fraction of held-out samples whose argmax logit equals the label (eval mode, no grad)."""
        pairs = self.held_out_logits(graph)
        correct = sum(int((logits.argmax(-1) == labels).sum()) for logits, labels in pairs)
        return correct / sum(int(labels.numel()) for _, labels in pairs)


class TensorTask(Task):
    """Evaluation on in-memory tensors: ``inputs`` (keyword tensors) and ``labels``, split into batches.

    With ``training=(inputs, labels)`` it also fine-tunes: ``train_steps`` plain SGD steps at
    ``learning_rate`` on cross-entropy, cycling through the training batches in order (deterministic; for
    tiny models and tests, not a replacement for the HF Trainer).
    """

    def __init__(self, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor, batch_size: int = 64,
                 calibration: tuple[Mapping[str, torch.Tensor], torch.Tensor] | None = None,
                 training: tuple[Mapping[str, torch.Tensor], torch.Tensor] | None = None, train_steps: int = 50,
                 learning_rate: float = 0.05) -> None:
        self._batches = _split(inputs, labels, batch_size)
        self._calib = None if calibration is None else _split(calibration[0], calibration[1], batch_size)
        self.training_batches = None if training is None else _split(training[0], training[1], batch_size)
        if type(train_steps) is not int or train_steps < 1:
            raise SearchError(f"TensorTask train_steps must be an integer >= 1, got {train_steps!r}")
        if not learning_rate >= 0:
            raise SearchError(f"TensorTask learning_rate must be >= 0, got {learning_rate!r}")
        self.train_steps, self.learning_rate = train_steps, float(learning_rate)

    def train(self, graph: ForgeGraph, trial: optuna.Trial | None, steps: int | None = None,
              checkpoints: Sequence[int] = (), on_checkpoint: Callable[[int], None] | None = None) -> None:
        import torch.nn.functional as F

        if not self.training_batches:
            raise SearchError("TensorTask cannot train without training=(inputs, labels); pass it, or use a space "
                              "that needs no fine-tuning")
        model = graph.model
        params = [p for p in model.parameters() if p.requires_grad]
        stops = set(checkpoints)
        model.train()
        try:
            for step in range(1, (steps or self.train_steps) + 1):
                inputs, labels = self.training_batches[(step - 1) % len(self.training_batches)]
                for p in params:
                    p.grad = None
                F.cross_entropy(logits_of(model(**with_labels(model, inputs, labels))).float(), labels).backward()
                with torch.no_grad():  # plain SGD by hand: torch.optim's first step imports torch._dynamo (~3 s)
                    for p in params:
                        if p.grad is not None:
                            p.sub_(p.grad, alpha=self.learning_rate)
                if step in stops and on_checkpoint is not None:
                    on_checkpoint(step)
        finally:
            model.eval()

    def eval_batches(self) -> Sequence[Batch]:
        return self._batches

    def calibration_batches(self) -> Sequence[Batch]:
        if self._calib is None:
            raise SearchError("TensorTask has no calibration data: pass calibration=(inputs, labels), held apart "
                              "from the evaluation tensors (needed by pruning method 'taylor')")
        return self._calib


def _split(inputs: Mapping[str, torch.Tensor], labels: torch.Tensor, batch_size: int) -> list[Batch]:
    return [({k: v[i:i + batch_size] for k, v in inputs.items()}, labels[i:i + batch_size])
            for i in range(0, int(labels.shape[0]), batch_size)]


class TextClassificationTask(Task):
    """Offline IMDb / Rotten Tomatoes classification through fxforge.data.

    Args:
        dataset: ``"imdb"`` or ``"rotten_tomatoes"``.
        checkpoint: tokenizer name (the offline MiniLM by default).
        train_size / eval_size: reviews used for fine-tuning / held-out accuracy.
        max_length: tokens per review; eval batches are padded to it (one static shape).
        train_args: ``get_trainer`` keyword overrides (``num_train_epochs``, ``learning_rate``, ``max_steps``, ...).
        eval_batch_size: batch size of the held-out batches.
        report_every: evaluate (and report to the pruner) every this many optimizer steps.
        progress: show the HF Trainer's progress bar while a trial trains.
        calibration_size: training reviews given to data-driven passes (taylor pruning).
    """

    def __init__(self, dataset: str = "imdb", checkpoint: str | None = None, train_size: int = 800,
                 eval_size: int = 200, max_length: int = 128, train_args: Mapping[str, Any] | None = None,
                 eval_batch_size: int = 32, report_every: int = 0, progress: bool = True,
                 calibration_size: int = 256) -> None:
        from ..data import get_tokenized_dataset
        from ..models.bert import MINILM_NAME

        if train_size < 1 or eval_size < 1:
            raise SearchError(f"train_size and eval_size must be >= 1, got {train_size}, {eval_size}")
        self.data, self.tokenizer = get_tokenized_dataset(
            dataset, checkpoint or MINILM_NAME, return_tokenizer=True, max_length=max_length, limit=train_size,
            test_limit=eval_size)
        self.max_length, self.eval_batch_size = max_length, eval_batch_size
        self.train_args = dict(train_args or {})
        self.report_every, self.progress = report_every, progress
        if calibration_size < 1:
            raise SearchError(f"calibration_size must be >= 1, got {calibration_size}")
        self.calibration_size = calibration_size
        self._eval: list[Batch] | None = None
        self._calib: list[Batch] | None = None

    def _padded(self, split: Any, n: int) -> list[Batch]:
        rows = [split[i] for i in range(min(n, len(split)))]
        out = []
        for i in range(0, len(rows), self.eval_batch_size):
            chunk = rows[i:i + self.eval_batch_size]
            enc = self.tokenizer.pad([{k: r[k] for k in ("input_ids", "attention_mask")} for r in chunk],
                                     padding="max_length", max_length=self.max_length, return_tensors="pt")
            labels = torch.tensor([int(r["labels"]) for r in chunk])
            out.append(({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, labels))
        return out

    def eval_batches(self) -> Sequence[Batch]:
        if self._eval is None:
            self._eval = self._padded(self.data["test"], len(self.data["test"]))
        return self._eval

    def calibration_batches(self) -> Sequence[Batch]:
        if self._calib is None:
            self._calib = self._padded(self.data["train"], self.calibration_size)
        return self._calib

    def train(self, graph: ForgeGraph, trial: optuna.Trial | None, steps: int | None = None,
              checkpoints: Sequence[int] = (), on_checkpoint: Callable[[int], None] | None = None) -> None:
        import tempfile

        from transformers import PrinterCallback, ProgressCallback, TrainerCallback

        from ..data import get_trainer

        task = self

        class _Report(TrainerCallback):
            def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **_: Any) -> None:
                if trial is None or not metrics or "eval_accuracy" not in metrics:
                    return
                import optuna

                trial.report(float(metrics["eval_accuracy"]), step=int(state.global_step))
                if trial.should_prune():
                    raise optuna.TrialPruned(f"pruned at step {state.global_step} "
                                             f"(accuracy {metrics['eval_accuracy']:.3f})")

        class _Rungs(TrainerCallback):
            """A fidelity's rungs: ``on_checkpoint`` after the listed optimizer steps (it may raise TrialPruned)."""

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if on_checkpoint is not None and int(state.global_step) in checkpoints:
                    on_checkpoint(int(state.global_step))

        class _Bar(ProgressCallback):
            """The Trainer's progress bar without its metric dicts (the trial's result says what counts)."""

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
                return None

        overrides = dict(task.train_args)
        training_args = dict(overrides.pop("training_args", {}))
        if steps is not None:  # a fidelity's last rung: wins over train_args' max_steps / epochs
            overrides.pop("max_steps", None)
            training_args["max_steps"] = steps
        # a bar per training, but none nested inside a search's progress bar
        training_args.setdefault("disable_tqdm", not self.progress or search_bar_shown())
        training_args.setdefault("logging_strategy", "no")
        if self.report_every:
            training_args.update(eval_strategy="steps", eval_steps=self.report_every)
        else:  # nothing to report to a pruner: the trial measures accuracy itself once, after all its steps
            training_args.setdefault("eval_strategy", "no")
        with tempfile.TemporaryDirectory(prefix="fxforge-trial-") as out:
            trainer = get_trainer(graph, self.data, self.tokenizer, output_dir=out, training_args=training_args,
                                  **overrides)
            trainer.add_callback(_Report())
            if checkpoints:
                trainer.add_callback(_Rungs())
            for noisy in (PrinterCallback, ProgressCallback):  # both print every metrics dict they are given
                trainer.remove_callback(noisy)
            if not training_args["disable_tqdm"]:
                trainer.add_callback(_Bar())
            trainer.train()
        graph.model.eval()


def finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise SearchError(f"objective {what} is not finite ({value})")
    return value
