"""A-GRU: shapes/gradients, the antisymmetric-minus-gamma recurrence, naive per-step rebuild, data helpers."""

from __future__ import annotations

import pytest
import torch

from fxforge.models.agru import AGRUCell, AGRUClassifier, digits_sequences, images_to_row_sequences


def test_shapes_and_gradients() -> None:
    torch.manual_seed(0)
    model = AGRUClassifier(input_size=8, hidden_size=16, num_layers=3, num_classes=10)
    x = torch.randn(4, 8, 8, requires_grad=True)
    logits = model(x)
    assert logits.shape == (4, 10)
    torch.nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_recurrent_matrix_is_antisymmetric_minus_gamma_identity() -> None:
    cell = AGRUCell(5, 12, gamma=0.03)
    A = cell.recurrent_matrix().detach()
    eye = torch.eye(12)
    torch.testing.assert_close(A + A.t(), -2 * 0.03 * eye)
    S = A + 0.03 * eye
    torch.testing.assert_close(S, -S.t())
    torch.testing.assert_close(torch.linalg.eigvals(A).real, torch.full((12,), -0.03), atol=1e-5, rtol=0)
    torch.testing.assert_close(A, cell.W_h - cell.W_h.t() - 0.03 * eye)


def test_cell_update_equation() -> None:
    torch.manual_seed(1)
    cell = AGRUCell(3, 4, epsilon=0.5, gamma=0.1)
    x, h = torch.randn(2, 3), torch.randn(2, 4)
    A = cell.W_h - cell.W_h.t() - 0.1 * torch.eye(4)
    z = torch.sigmoid(h @ A.t() + x @ cell.V_z.t() + cell.b_z)
    c = torch.tanh(h @ A.t() + x @ cell.V_h.t() + cell.b_h)
    torch.testing.assert_close(cell(x, h), h + 0.5 * z * c)


def test_matrix_and_identity_rebuilt_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The naive baseline builds torch.eye once per time step and layer (what the compiler passes remove)."""
    calls = []
    real_eye = torch.eye

    def counting_eye(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args)
        return real_eye(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "eye", counting_eye)
    model = AGRUClassifier(input_size=4, hidden_size=6, num_layers=2, num_classes=3)
    model(torch.randn(2, 5, 4))
    assert len(calls) == 5 * 2


def test_fx_symbolic_trace_fails_but_export_unrolls_the_loop() -> None:
    model = AGRUClassifier(input_size=8, hidden_size=8, num_layers=2, num_classes=10).eval()
    x = torch.randn(2, 8, 8)
    with pytest.raises((torch.fx.proxy.TraceError, TypeError)):
        torch.fx.symbolic_trace(model)
    ep = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x))
    eyes = [n for n in ep.graph.nodes if n.op == "call_function" and "eye" in str(n.target)]
    assert len(eyes) == 8 * 2  # one identity per unrolled step and layer


def test_digits_as_row_sequences() -> None:
    x_tr, y_tr, x_te, y_te = digits_sequences()
    assert x_tr.shape[1:] == (8, 8) and x_te.shape[1:] == (8, 8)
    assert x_tr.shape[0] + x_te.shape[0] == 1797 and x_te.shape[0] == 450
    assert 0.0 <= x_tr.min() and x_tr.max() <= 1.0
    assert set(y_tr.tolist()) == set(range(10)) and y_te.dtype == torch.long


def test_mnist_shaped_images_read_row_by_row() -> None:
    images = torch.randint(0, 256, (3, 1, 28, 28), dtype=torch.uint8)
    seq = images_to_row_sequences(images)
    assert seq.shape == (3, 28, 28) and seq.dtype == torch.float32 and seq.max() <= 1.0
    torch.testing.assert_close(seq[1, 5], images[1, 0, 5].float() / 255.0)
    model = AGRUClassifier(input_size=28, hidden_size=8, num_layers=1, num_classes=10)
    assert model(seq).shape == (3, 10)
    with pytest.raises(ValueError):
        images_to_row_sequences(torch.zeros(3, 3, 28, 28))


def test_short_training_learns_digits() -> None:
    from fxforge.examples.train_agru import train

    _, acc = train(epochs=3, hidden_size=32, num_layers=1)
    assert acc > 0.5


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        AGRUCell(0, 4)
    with pytest.raises(ValueError):
        AGRUCell(3, 4, epsilon=0.0)
    with pytest.raises(ValueError):
        AGRUClassifier(8, num_layers=0)
    with pytest.raises(ValueError, match="batch, time, features"):
        AGRUClassifier(8)(torch.randn(8, 8))
