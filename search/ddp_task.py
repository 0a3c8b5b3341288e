"""A task whose fine-tune runs data-parallel on every rank of a process group (DDP), for distributed trials.

The wrapped task's data and measurements are unchanged (every rank holds the same batches); only training
differs: each rank trains on its shard of every batch and DDP averages the gradients, so with the same global
batch the trained weights equal a single process's up to float rounding. A :class:`TensorTask` trains with
its own SGD steps over contiguous shards (``shard_rows``, weighted so uneven shards still average to the whole
batch's gradient); a :class:`TextClassificationTask` trains through ``get_trainer``, whose HF Trainer runs DDP
in the initialised group with a DistributedSampler (per-device batch = the task's batch / world size; the
sampler's order differs from a single process's, so its values match in distribution, not exactly).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import SearchError
from .task import Batch, Task, TensorTask, TextClassificationTask, logits_of, with_labels

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph

__all__ = ["DDPTask"]


class DDPTask(Task):
    """``inner`` with its fine-tune data-parallel over the initialised process group (``rank`` of ``world``);
    ``timeout`` (s) bounds the HF Trainer's collectives. ``on_start()`` runs before each training (rank 0
    announces the trial there) and ``on_end(status)`` after it, with what this rank trained on (rank, rows...)."""

    def __init__(self, inner: Task, rank: int, world: int, timeout: float,
                 on_start: Callable[[], None] | None = None,
                 on_end: Callable[[dict[str, Any]], object] | None = None) -> None:
        if not isinstance(inner, TensorTask | TextClassificationTask) or (
                isinstance(inner, TensorTask) and type(inner).train is not TensorTask.train):
            raise SearchError(f"distributed trials train a TensorTask or a TextClassificationTask (HF Trainer); "
                              f"{type(inner).__name__} trains its own way: run it single-process (no --ddp)")
        self.inner, self.rank, self.world, self.timeout = inner, rank, world, timeout
        self.on_start, self.on_end = on_start, on_end

    def __getattr__(self, name: str) -> Any:
        """Anything else (an objective reading ``task.tokenizer``, say) is the wrapped task's."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def eval_batches(self) -> Sequence[Batch]:
        return self.inner.eval_batches()

    def calibration_batches(self) -> Sequence[Batch]:
        return self.inner.calibration_batches()

    def train(self, graph: ForgeGraph, trial: optuna.Trial | None, steps: int | None = None,
              checkpoints: Sequence[int] = (), on_checkpoint: Callable[[int], None] | None = None) -> None:
        if checkpoints:
            raise SearchError("distributed trials do not measure fidelity rungs mid-training: drop the fidelity "
                              "schedule or run single-process")
        if self.on_start is not None:
            self.on_start()
        if isinstance(self.inner, TensorTask):
            status = _train_tensors(self.inner, graph, self.rank, self.world, steps)
        else:
            status = _train_hf(self.inner, graph, trial, self.world, self.timeout, steps)
        if self.on_end is not None:
            self.on_end({"rank": self.rank, **status})


def _train_tensors(task: TensorTask, graph: ForgeGraph, rank: int, world: int,
                   steps: int | None) -> dict[str, Any]:
    """TensorTask's SGD steps (same batches, same order, same rate) with each batch's rows shared out among the
    ranks and the gradients averaged by DDP; returns the rows and steps this rank trained on."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from ..distributed.ddp import shard_rows, shard_weight

    batches = task.training_batches
    if not batches:
        raise SearchError("TensorTask cannot train without training=(inputs, labels); pass it, or use a space "
                          "that needs no fine-tuning")
    small = min(int(labels.shape[0]) for _, labels in batches)
    if small < world:
        raise SearchError(f"a training batch of {small} rows cannot be shared among {world} ranks: use a batch "
                          f"of at least {world} rows or fewer ranks")
    model = graph.model
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters and buffers to every rank
    rows_seen = 0
    model.train()
    try:
        for step in range(1, (steps or task.train_steps) + 1):
            inputs, labels = batches[(step - 1) % len(batches)]
            count = int(labels.shape[0])
            part = shard_rows(count, rank, world)
            mine = {k: v[part] for k, v in inputs.items()}
            for p in params:
                p.grad = None
            out = ddp(**with_labels(model, mine, labels[part]))
            loss = F.cross_entropy(logits_of(out).float(), labels[part]) * shard_weight(count, rank, world)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            with torch.no_grad():  # TensorTask's plain SGD step
                for p in params:
                    if p.grad is not None:
                        p.sub_(p.grad, alpha=task.learning_rate)
            rows_seen += part.stop - part.start
    finally:
        model.eval()
    return {"rows": rows_seen, "steps": step}


def _train_hf(task: TextClassificationTask, graph: ForgeGraph, trial: optuna.Trial | None, world: int,
              timeout: float, steps: int | None) -> dict[str, Any]:
    """The task's HF Trainer fine-tune in the initialised group (the Trainer wraps the model in DDP and shards
    batches with a DistributedSampler), keeping the task's global batch: per-device batch = batch / world."""
    overrides = dict(task.train_args)
    training_args = dict(overrides.pop("training_args", {}))
    batch = int(overrides.get("per_device_train_batch_size") or training_args.get("per_device_train_batch_size")
                or 8)
    if batch % world:
        raise SearchError(f"the task's training batch of {batch} cannot be split evenly among {world} ranks: set "
                          "train_args per_device_train_batch_size to a multiple of the number of ranks")
    overrides["per_device_train_batch_size"] = batch // world
    training_args.pop("per_device_train_batch_size", None)
    training_args["ddp_timeout"] = max(1, int(timeout))
    shard = copy.copy(task)  # the same data, this rank's Trainer settings
    shard.train_args = {**overrides, "training_args": training_args}
    shard.train(graph, trial, steps)
    return {"per_device_batch": batch // world}
