"""Issue 30, item 1's acceptance test: sensitivity_analysis_pass's per-layer ranking agrees with the accuracy
drop measured when each layer alone is quantized, on a tiny BERT trained on a real task (Spearman >= 0.7).

The task: scikit-learn's handwritten digits (1,797 real 8x8 scans, bundled with scikit-learn, so offline),
each image 2x2-pooled to 4x4 and read as 16 tokens (its grey levels) after a CLS token: the class is in how
grey levels sit at positions, so the attention and FFN layers carry it (tokens alone do not, as words do for
IMDb sentiment, where a tiny BERT's layers barely matter). Trained on 1,000 images at random one-pixel
shifts; held out: the other 797 at all 9 shifts (7,173 samples), so one layer's drop is resolved to a few
tenths of a point (standard error clustered by image) instead of the ~1 pt of 797 samples.
Training runs on one thread with deterministic algorithms (a different thread count sums in another order
and trains another model); the measurement and every method then run at 1 and at 2 threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from fxforge import ForgeGraph, passes
from fxforge.models.bert import tiny_bert

WIDTH = 2  # the candidate whose drops are measured: the coarsest, where layers differ most
SHIFTS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
TRAIN_IMAGES, STEPS = 1000, 2500


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` threads with deterministic algorithms; restore both after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(n)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _shift(images: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Images moved by (dy, dx) pixels, zero (background) filled."""
    out = torch.zeros_like(images)
    h, w = images.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        images[..., max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def _batch(images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """BERT inputs: token 0 (CLS), then the 16 pooled grey levels (0..64, in 17 steps) as tokens 1..17."""
    pooled = images.view(-1, 4, 2, 4, 2).sum((2, 4)).reshape(-1, 16) // 4 + 1
    ids = torch.cat([torch.zeros(len(images), 1, dtype=torch.long), pooled], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0))
    return torch.tensor(digits.data, dtype=torch.long).view(-1, 8, 8)[order], torch.tensor(digits.target)[order]


def _shifted_samples(images: torch.Tensor, labels: torch.Tensor, n: int, gen: torch.Generator
                     ) -> dict[str, torch.Tensor]:
    """``n`` training images drawn at random, each at a random one-pixel shift."""
    idx = torch.randint(0, len(images), (n,), generator=gen)
    shift = torch.randint(0, len(SHIFTS), (n,), generator=gen)
    moved = torch.stack([_shift(images[i], *SHIFTS[s]) for i, s in zip(idx.tolist(), shift.tolist())])
    return _batch(moved, labels[idx])


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties), without scipy."""
    def ranks(x: list[float]) -> torch.Tensor:
        t = torch.tensor(x, dtype=torch.float64)
        r = torch.empty_like(t)
        r[torch.argsort(t)] = torch.arange(len(x), dtype=torch.float64)
        for v in t.unique():
            r[t == v] = r[t == v].mean()
        return r - r.mean()
    ra, rb = ranks(a), ranks(b)
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _measured_drops(mg: ForgeGraph, held_out: dict[str, torch.Tensor], names: list[str]
                    ) -> tuple[float, list[float], list[float], float]:
    """Clean accuracy; per layer, the held-out accuracy drop with that layer alone quantized to WIDTH bits by
    quantize_transform_pass, and its standard error (per-image means of the 9 shifts, so clustered by image);
    the drops' split-half Spearman (even vs odd held-out images): how well the measurement ranks itself."""
    def correct(g: ForgeGraph) -> torch.Tensor:
        with torch.no_grad():
            return (g(**held_out).logits.argmax(-1) == held_out["labels"]).double()

    clean = correct(mg)
    config = {"name": "integer", "weight_width": WIDTH, "weight_frac_width": "auto"}
    drops, errors, halves = [], [], []
    for name in names:
        diff = (clean - correct(passes.quantize_transform_pass(mg, {"by": "name", name: {"config": config}})[0]))
        per_image = diff.view(len(SHIFTS), -1).mean(0)
        drops.append(float(diff.mean()))
        errors.append(float(per_image.std() / len(per_image) ** 0.5))
        halves.append((float(per_image[0::2].mean()), float(per_image[1::2].mean())))
    return float(clean.mean()), drops, errors, _spearman([a for a, _ in halves], [b for _, b in halves])


@pytest.mark.slow_search
def test_ranking_agrees_with_measured_accuracy_drops() -> None:
    """Spearman over the 14 Linears between each method's 2-bit estimate (8 calibration batches of 32 training
    images) and the measured held-out accuracy drop: printed for every method, asserted >= 0.7 for "loss", the one
    that reaches it with another training seed too (the others do not: see passes/analysis/sensitivity.py)."""
    images, labels = _digits()
    train_x, train_y = images[:TRAIN_IMAGES], labels[:TRAIN_IMAGES]
    held_out = _batch(torch.cat([_shift(images[TRAIN_IMAGES:], *s) for s in SHIFTS]),
                      labels[TRAIN_IMAGES:].repeat(len(SHIFTS)))
    gen = torch.Generator().manual_seed(0)
    with _threads(1):
        # the test suite's tiny BERT (2 layers, hidden 32, 4 heads), its vocabulary and positions sized to the task
        model = tiny_bert(num_labels=10, vocab_size=18, num_attention_heads=4, max_position_embeddings=17).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(STEPS):
            loss = model(**_shifted_samples(train_x, train_y, 64, gen)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    calibration = [_shifted_samples(train_x, train_y, 32, gen) for _ in range(8)]
    mg = ForgeGraph(model.eval(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()
    names = [name for _, name, _, _ in passes.select.select_nodes(mg.model, {"type": ["linear"]})]
    rho: dict[int, dict[str, float]] = {}
    measured: dict[int, Any] = {}
    for threads in (1, 2):
        with _threads(threads):
            accuracy, drops, errors, split_half = measured[threads] = _measured_drops(mg, held_out, names)
            rho[threads] = {}
            for method in ("fisher", "hessian_trace", "sqnr", "loss"):
                _, info = passes.sensitivity_analysis_pass(mg, {"data": calibration, "method": method,
                                                                "widths": [WIDTH], "prune_ratios": []})
                by_name = {s.name: s.delta(WIDTH) for s in info.layers}
                rho[threads][method] = _spearman([by_name[n] for n in names], drops)
        print(f"{threads} thread(s): held-out accuracy {accuracy:.4f} on {len(held_out['labels'])} samples; "
              f"2-bit accuracy drops {[round(d, 4) for d in drops]} (standard errors "
              f"{[round(e, 4) for e in errors]}; split-half Spearman {split_half:.3f}); "
              f"Spearman {({m: round(r, 3) for m, r in rho[threads].items()})}")
    accuracy, drops, errors, _ = measured[1]
    assert accuracy > 0.6  # ten classes (chance 0.1), shifted and pooled to 4x4: the model learned the task
    # the measurement resolves the layers: most drops lie beyond two standard errors of zero
    assert sum(abs(d) > 2 * e for d, e in zip(drops, errors)) >= len(names) // 2, (drops, errors)
    for threads in (1, 2):
        assert rho[threads]["loss"] >= 0.7, rho
