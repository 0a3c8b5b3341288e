"""Model zoo: GPT with attention/AFNO mixers, the naive A-GRU baseline, and BERT classifiers.

The BERT helpers import ``transformers`` and are loaded lazily on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from .afno import AFNO1D
from .agru import AGRUCell, AGRUClassifier, digits_sequences, images_to_row_sequences
from .gpt import GPT, GPTConfig, lm_loss, param_groups

_LAZY_BERT = (
    "tiny_bert",
    "minilm_for_sequence_classification",
    "minilm_tokenizer",
    "minilm_path",
    "load_sequence_classifier",
    "load_tokenizer",
)

__all__ = [
    "AFNO1D",
    "AGRUCell",
    "AGRUClassifier",
    "GPT",
    "GPTConfig",
    "digits_sequences",
    "images_to_row_sequences",
    "lm_loss",
    "param_groups",
    *_LAZY_BERT,
]


def __getattr__(name: str) -> Any:
    """Import the transformers-based BERT helpers only when they are first used."""
    if name in _LAZY_BERT:
        return getattr(importlib.import_module(".bert", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
