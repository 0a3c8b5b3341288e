"""The stored-writes rule (a checkpoint's graph never changes its weights) follows real aliasing: a value an op
computes afresh from a weight (a matmul) may be changed in place, while views, reshapes, transposes and ops that
may hand back their input (composites such as ``type_as`` or eval-mode ``dropout``) stay refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from reach.tiny_archs import at_capture_size, build, capture_inputs, check_inputs

from fxforge import ForgeGraph
from fxforge.graph.stored_writes import fresh_composites
from fxforge.graph.targets import CheckpointError


def test_falcon_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    """Falcon's MLP adds the residual in place into ``x @ weight.T``: a fresh product, not the weight."""
    model = build("falcon")
    mg = ForgeGraph(model, example_inputs=capture_inputs("falcon"))
    back = ForgeGraph.from_checkpoint(mg.eval().export(tmp_path / "falcon")).eval()
    cases = check_inputs("falcon")
    assert len({tuple(x["input_ids"].shape) for x in cases}) == 2
    for x in cases:
        assert (x["attention_mask"] == 0).any()  # a padded row
        with torch.no_grad():
            got, want = back(**x).logits, model(**x).logits
        assert got.shape == (*x["input_ids"].shape, 99)
        assert torch.equal(got, want), {k: tuple(v.shape) for k, v in x.items()}


def test_funnel_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    """Funnel (default separate_cls) scales ``einsum(q + v, r_head)`` in place by its cls mask, where ``r_head``
    is an einsum of the ``r_kernel`` weight: a two-operand einsum is a fresh product, not the weight. Funnel's
    length is static (its positions are a Python list), so the two shapes differ in batch only."""
    model = build("funnel")
    assert model.config.separate_cls
    mg = ForgeGraph(model, example_inputs=capture_inputs("funnel"))
    back = ForgeGraph.from_checkpoint(mg.eval().export(tmp_path / "funnel")).eval()
    for batch in (3, 1):
        x = at_capture_size("funnel", batch, seed=batch)
        assert (x["attention_mask"] == 0).any()  # a padded row
        with torch.no_grad():
            got, want = back(**x).logits, model(**x).logits
        assert got.shape == (batch, 2)
        assert torch.equal(got, want), batch


class _Writes(nn.Module):
    """Changes in place the result of ``make(x, w)`` (a frozen ``w`` lets eager and torch.export write through
    a view of it, so the checkpoint rule is what refuses)."""

    def __init__(self, make: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], frozen: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4), requires_grad=not frozen)
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.make(x, self.w)
        y.add_(1)
        return x @ self.w + y.sum()


FRESH: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "matmul": lambda x, w: x @ w,
    "torch_matmul": lambda x, w: torch.matmul(x, w),
    "linear": lambda x, w: torch.nn.functional.linear(x, w),
    "mul": lambda x, w: w * 2,
    "einsum_matmul": lambda x, w: torch.einsum("ij,jk->ik", x, w),
    "einsum_mul": lambda x, w: torch.einsum("ij,ij->ij", w, w),
    "einsum_scalar": lambda x, w: torch.einsum("ij,->ji", w, x.sum()),
    "einsum_list": lambda x, w: torch.einsum("ij,kj->ikj", [w, x]),
}
ALIASING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "view": lambda x, w: w.view(-1),
    "t": lambda x, w: w.t(),
    "transpose_attribute": lambda x, w: w.T,
    "reshape": lambda x, w: w.reshape(2, 8),
    "flatten": lambda x, w: w.flatten(),
    "getitem": lambda x, w: w[1:],
    "expand": lambda x, w: w.expand(2, 4, 4),
    "data": lambda x, w: w.data,
    "detach": lambda x, w: w.detach(),
    "contiguous": lambda x, w: w.contiguous(),
    "type_as": lambda x, w: w.type_as(x),
    "eval_dropout": lambda x, w: torch.nn.functional.dropout(w, 0.5, training=False),
    "in_place_returns_self": lambda x, w: w.detach().mul_(1),
    "einsum_one_transpose": lambda x, w: torch.einsum("ij->ji", w),
    "einsum_one_diagonal": lambda x, w: torch.einsum("ii->i", w),
    "einsum_one_in_a_list": lambda x, w: torch.einsum("ij->ij", [w]),
}


def _export(make: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], frontend: str, path: Path) -> Path:
    torch.manual_seed(0)
    model = _Writes(make, frozen=True)
    mg = ForgeGraph(model, example_inputs=(torch.randn(3, 4),), frontend=frontend)  # type: ignore[arg-type]
    return mg.export(path)


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("kind", sorted(FRESH))
def test_in_place_on_a_fresh_result_exports_and_leaves_the_weight_alone(tmp_path: Path, frontend: str,
                                                                         kind: str) -> None:
    torch.manual_seed(0)
    model = _Writes(FRESH[kind])
    mg = ForgeGraph(model, example_inputs=(torch.randn(3, 4),), frontend=frontend)  # type: ignore[arg-type]
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "ckpt"))
    weight = model.w.detach().clone()
    for x in (torch.randn(3, 4), torch.randn(5, 4)):
        with torch.no_grad():
            assert torch.equal(back(x), model(x))
    assert torch.equal(back.model.w, weight) and torch.equal(model.w, weight)


# torch.export cannot trace ``.data`` (it lifts a fake constant); fx keeps it as getattr(w, "data").
REFUSED = [(k, fe) for k in sorted(ALIASING) for fe in ("fx", "export") if (k, fe) != ("data", "export")]


@pytest.mark.parametrize(("kind", "frontend"), REFUSED)
def test_in_place_on_what_may_alias_a_weight_is_refused(tmp_path: Path, frontend: str, kind: str) -> None:
    with pytest.raises(CheckpointError, match=r"writes in place to '\w+', which may share storage with the stored "
                                              r"tensor 'w'.*never change them"):
        _export(ALIASING[kind], frontend, tmp_path / "ckpt")


# einsum equations with two or more operands over the branches of ATen's einsum: mul (nothing summed) or bmm,
# broadcasting size-1 and 0-d operands, outer products, a diagonal of one operand, ellipses, implicit output,
# empty operands, everything summed, the same tensor twice, three operands with and without a path.
EINSUM: list[tuple[str, tuple[tuple[int, ...], ...]]] = [
    ("ij,jk->ik", ((3, 4), (4, 5))), ("i,i->i", ((4,), (4,))), ("i,->i", ((4,), ())), (",->", ((), ())),
    ("ij,ij->ij", ((3, 4), (3, 4))), ("ij,ij->ji", ((3, 4), (3, 4))), ("ij,ij->ij", ((3, 4), (1, 1))),
    ("ij,ij->ij", ((1, 1), (1, 1))), ("i,j->ij", ((3,), (4,))), ("ij,kj->ikj", ((3, 4), (5, 4))),
    ("ij,j->i", ((3, 4), (4,))), ("ij,k->ij", ((3, 4), (1,))), ("ij,k->ij", ((3, 4), (5,))),
    ("ij,ij->", ((3, 4), (3, 4))), ("i,i->", ((1,), (1,))), ("ii,i->i", ((3, 3), (3,))),
    ("...i,...i->...i", ((2, 3), (1, 3))), ("ij,jk", ((3, 4), (4, 5))), ("ij,ij->ij", ((0, 4), (0, 4))),
    ("binh,tnh->bnit", ((2, 5, 4, 8), (5, 4, 8))), ("bind,bjnd->bnij", ((2, 5, 4, 8), (2, 6, 4, 8))),
    ("ij,jk,kl->il", ((3, 4), (4, 5), (5, 2))), ("i,i,i->i", ((4,), (4,), (4,))), ("i,,->i", ((4,), (), ())),
]


def _einsum_operands() -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for equation, shapes in EINSUM:
        tensors = [torch.randn(s) for s in shapes]
        out.append((equation, tensors))
        if tensors[0].dim() == 2:  # a transposed (non-contiguous) first operand
            out.append((equation, [torch.randn(tensors[0].shape[::-1]).mT, *tensors[1:]]))
        if len(shapes) == 2 and shapes[0] == shapes[1]:  # the same tensor twice
            out.append((equation, [tensors[0], tensors[0]]))
        if len(shapes) == 3:
            out.append((equation, tensors, [1, 2, 0, 1]))  # an explicit contraction path
    return out


def _operands(name: str) -> list[tuple[Any, ...]]:
    """Operands over every rank combination the composite's kernel branches on (1-D to 4-D, broadcasting
    batches, empty, contiguous or transposed second operand; linear with and without a bias)."""
    shapes = [((4,), (4,)), ((3, 4), (4,)), ((4,), (4, 5)), ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)),
              ((2, 3, 4), (2, 4, 5)), ((3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (2, 4, 5)),
              ((2, 3, 4), (4,)), ((1, 4), (4, 1)), ((0, 4), (4, 5))]
    if name == "aten::einsum":
        return _einsum_operands()
    out: list[tuple[Any, ...]] = []
    for a_shape, b_shape in shapes:
        a = torch.randn(a_shape)
        seconds = [torch.randn(b_shape)] + ([torch.randn(b_shape[::-1]).mT] if len(b_shape) > 1 else [])
        for b in seconds:
            if name == "aten::matmul":
                out.append((a, b))
            elif b.dim() == 2:  # linear: weight [out, in]
                out += [(a, b.mT), (a, b.mT, torch.randn(b.shape[1]))]
    return out


@pytest.mark.parametrize("name", sorted(fresh_composites()))
def test_every_fresh_composite_allocates(name: str) -> None:
    """Each composite ATen op the rule treats as fresh returns storage none of its operands has."""
    op = getattr(torch.ops.aten, name.split("::")[1])
    ran = 0
    for args in _operands(name):
        try:
            out = op(*args[:2], path=args[2]) if name == "aten::einsum" and len(args) > 2 else op(*args)
        except RuntimeError:  # shapes this op refuses
            continue
        ran += 1
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in tensors]
        stored = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
        assert out.untyped_storage().data_ptr() not in stored, (name, args[0], [tuple(t.shape) for t in tensors])
        out.add_(1)
        assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert ran >= 10
