"""Train the naive A-GRU classifier on scikit-learn's digits (8 rows of 8 pixels) and report test accuracy.

Run: ``python -m fxforge.examples.train_agru`` (about half a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ..models.agru import AGRUClassifier, digits_sequences


def evaluate(model: AGRUClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``."""
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def train(
    epochs: int = 40,
    batch_size: int = 64,
    lr: float = 5e-3,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
) -> tuple[AGRUClassifier, float]:
    """Train on the digits training split; return the model and its test accuracy."""
    if epochs <= 0 or batch_size <= 0 or lr <= 0:
        raise ValueError("epochs, batch_size and lr must be positive")
    torch.manual_seed(seed)
    x_tr, y_tr, x_te, y_te = digits_sequences(seed=seed)
    model = AGRUClassifier(input_size=8, hidden_size=hidden_size, num_layers=num_layers, num_classes=10,
                           epsilon=1.0, gamma=0.01)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(x_tr.size(0))
        total = 0.0
        for i in range(0, x_tr.size(0), batch_size):
            batch = perm[i : i + batch_size]
            loss = F.cross_entropy(model(x_tr[batch]), y_tr[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * batch.numel()
        sched.step()
        if (epoch + 1) % 10 == 0 or epoch == 0:
            print(f"epoch {epoch + 1:3d}  train loss {total / x_tr.size(0):.4f}  "
                  f"test acc {evaluate(model, x_te, y_te):.4f}  ({time.perf_counter() - start:.1f}s)")
    acc = evaluate(model, x_te, y_te)
    print(f"final digits test accuracy: {acc:.4f} on {x_te.size(0)} held-out images "
          f"({time.perf_counter() - start:.1f}s)")
    return model, acc


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train(args.epochs, args.batch_size, args.lr, args.hidden_size, args.num_layers, args.seed)


if __name__ == "__main__":
    main()
