"""Movement pruning (Sanh et al. 2020) and MASE's other pruning analyses: add_movement_metadata_analysis_pass
accumulates -sum(w * grad) over training steps (a plain loop, or the HF Trainer through a callback) into typed
metadata that prune_transform_pass's method "movement" reads; add_natural_sparsity_metadata_analysis_pass counts
exact zeros; MASE's hook passes are accepted as no-ops."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import bert_inputs, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.passes import PassArgsError, PassError
from fxforge.passes.analysis.natural_sparsity import NaturalSparsityRecord
from fxforge.passes.prune import prune_transform_pass
from fxforge.passes.prune.movement import MovementRecord, add_movement_metadata_analysis_pass

SHAPES = [(8, 16, 3), (5, 7, 4)]


class MLP(nn.Module):
    """in -> hidden -> out with a ReLU, so activations hold exact zeros."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _graph(model: nn.Module, x: torch.Tensor) -> ForgeGraph:
    mg = ForgeGraph(model, (x,))
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _node(mg: ForgeGraph, target: str) -> Any:
    return next(n for n in mg.nodes if n.op == "call_module" and n.target == target)


def _scores(mg: ForgeGraph, target: str) -> torch.Tensor:
    from fxforge.graph.metadata import get_meta

    rec = get_meta(_node(mg, target)).software.get(MovementRecord)
    assert rec is not None
    return torch.tensor(rec.scores, dtype=torch.float64).reshape(rec.shape)


@pytest.mark.parametrize("dims", SHAPES)
def test_movement_scores_are_minus_sum_of_weight_times_grad(dims: tuple[int, int, int]) -> None:
    d_in, hidden, d_out = dims
    mg = _graph(MLP(*dims), torch.randn(4, d_in))
    mg, info = add_movement_metadata_analysis_pass(mg)
    assert info.layers == ("fc1", "fc2") and info.steps == 0
    assert torch.count_nonzero(_scores(mg, "fc1")) == 0  # registered: zeros until a step is recorded
    opt = torch.optim.SGD(mg.model.parameters(), lr=0.1)
    expected = {p: torch.zeros(mg.model.get_submodule(p).weight.shape, dtype=torch.float64) for p in info.layers}
    for step in range(3):
        x, y = torch.randn(6 + step, d_in), torch.randint(0, d_out, (6 + step,))
        nn.functional.cross_entropy(mg.model(x), y).backward()
        for p in info.layers:  # by hand, before the optimizer moves the weights
            w = mg.model.get_submodule(p).weight
            expected[p] -= (w.detach() * w.grad).double()
        info.tracker.step()
        opt.step()
        opt.zero_grad()
    info.tracker.flush()
    for p in info.layers:
        assert torch.allclose(_scores(mg, p), expected[p], atol=1e-6)
        assert get_steps(mg, p) == 3


def get_steps(mg: ForgeGraph, target: str) -> int:
    from fxforge.graph.metadata import get_meta

    rec = get_meta(_node(mg, target)).software.get(MovementRecord)
    assert rec is not None
    return rec.steps


def _ranked_case() -> tuple[ForgeGraph, dict[str, Any]]:
    """A Linear(4 -> 1) with all-ones weights and loss = output sum: grad = x, so w * grad = x. Taylor keeps the
    largest |x|, movement the largest -x (weights the loss pushes away from zero)."""
    lin = nn.Sequential(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        lin[0].weight.fill_(1.0)
    x = torch.tensor([[3.0, -0.5, 0.1, -2.0]])
    return _graph(lin, x), {"x": x}


def test_movement_and_taylor_rank_weights_differently() -> None:
    mg, batch = _ranked_case()
    taylor, _ = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "method": "taylor"}, "data": [(batch["x"],)],
                                          "loss_fn": lambda out, b: out.sum()})
    mg, info = add_movement_metadata_analysis_pass(mg)
    mg.model(batch["x"]).sum().backward()
    info.tracker.step()
    info.tracker.flush()
    for p in mg.model.parameters():
        p.grad = None
    moved, pinfo = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "method": "movement"}})
    assert pinfo.method == "movement"
    assert taylor.model.get_submodule("0").weight_mask.tolist() == [[True, False, False, True]]  # |x|: 3, 2 kept
    assert moved.model.get_submodule("0").weight_mask.tolist() == [[False, True, False, True]]  # -x: 0.5, 2 kept


def test_movement_without_recorded_scores_is_refused() -> None:
    mg, _ = _ranked_case()
    with pytest.raises(PassError, match="add_movement_metadata_analysis_pass"):
        prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "method": "movement"}})


def test_all_ones_masks_keep_outputs_and_structured_movement_prunes_rows() -> None:
    mg = _graph(MLP(8, 16, 3), torch.randn(4, 8))
    mg, info = add_movement_metadata_analysis_pass(mg)
    x = torch.randn(5, 8)
    nn.functional.cross_entropy(mg.model(x), torch.tensor([0, 1, 2, 0, 1])).backward()
    info.tracker.step()
    info.tracker.flush()
    kept, _ = prune_transform_pass(mg, {"weight": {"sparsity": 0.0, "method": "movement"}})
    with torch.no_grad():
        assert torch.equal(kept.model(x), mg.model(x))
    rows, rinfo = prune_transform_pass(mg, {"weight": {"sparsity": 0.25, "method": "movement", "granularity": "row"},
                                            "targets": {"name": ["fc1"]}})
    row_scores = _scores(mg, "fc1").sum(1)
    dropped = ~rows.model.fc1.weight_mask.all(1)
    assert rinfo.units_pruned == 4 and set(torch.nonzero(dropped).flatten().tolist()) == set(
        torch.argsort(row_scores)[:4].tolist())


class _HandlerTrainer:
    """What the pass needs of an HF Trainer: its real CallbackHandler and add_callback."""

    def __init__(self) -> None:
        from transformers.trainer_callback import CallbackHandler

        self.callback_handler = CallbackHandler([], None, None, None, None)

    def add_callback(self, cb: Any) -> None:
        self.callback_handler.add_callback(cb)


def test_trainer_callback_steps_at_each_optimizer_step_then_writes_and_removes_itself() -> None:
    from transformers.trainer_callback import TrainerControl, TrainerState

    mg = _graph(MLP(8, 16, 3), torch.randn(4, 8))
    trainer = _HandlerTrainer()
    handler = trainer.callback_handler
    mg, info = add_movement_metadata_analysis_pass(mg, {"trainer": trainer, "targets": {"name": ["fc2"]}})
    assert info.layers == ("fc2",) and len(handler.callbacks) == 1
    expected = torch.zeros(3, 16, dtype=torch.float64)
    state, control = TrainerState(), TrainerControl()
    for _ in range(2):
        mg.model(torch.randn(5, 8)).square().sum().backward()
        w = mg.model.fc2.weight
        expected -= (w.detach() * w.grad).double()
        handler.on_pre_optimizer_step(None, state, control)
        with torch.no_grad():
            w -= 0.1 * w.grad
        mg.model.zero_grad()
    assert get_steps(mg, "fc2") == 0  # written at the end of training, not per step
    handler.on_train_end(None, state, control)
    assert handler.callbacks == [] and get_steps(mg, "fc2") == 2
    assert torch.allclose(_scores(mg, "fc2"), expected, atol=1e-6)
    with pytest.raises(PassArgsError, match="HF Trainer"):
        add_movement_metadata_analysis_pass(mg, {"trainer": object()})


@pytest.mark.slow
def test_hf_trainer_callback_records_each_optimizer_step_and_leaves_nothing_behind(tmp_path: Any) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fxforge.data import CapturedModelAdapter

    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"])
    mg, _ = passes.init_metadata_analysis_pass(mg)
    name = "bert.encoder.layer.0.attention.self.query"
    seen: list[torch.Tensor] = []

    class ByHand(TrainerCallback):  # records -w * grad where the optimizer is about to step, independently
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            w = mg.model.get_submodule(name).weight
            seen.append(-(w.detach() * w.grad).double())

    batch = bert_inputs(batch=2, seq=8)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)] * 3
    trainer = Trainer(model=CapturedModelAdapter(mg.model), train_dataset=rows, callbacks=[ByHand()],
                      args=TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                             report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                                             remove_unused_columns=False))
    before = len(trainer.callback_handler.callbacks)
    mg, info = add_movement_metadata_analysis_pass(mg, {"trainer": trainer, "targets": {"type": "linear"}})
    assert len(trainer.callback_handler.callbacks) == before + 1
    trainer.train()
    assert len(trainer.callback_handler.callbacks) == before  # removed itself at the end of training
    assert len(seen) == 3 and get_steps(mg, name) == 3
    assert torch.allclose(_scores(mg, name), sum(seen), atol=1e-6)  # type: ignore[arg-type]
    heads, hinfo = prune_transform_pass(mg, {"weight": {"sparsity": 0.5, "method": "movement", "granularity": "head"}})
    assert hinfo.units_pruned == hinfo.units_total // 2


@pytest.mark.parametrize("dims", SHAPES)
def test_natural_sparsity_equals_a_direct_count(dims: tuple[int, int, int]) -> None:
    d_in, hidden, d_out = dims
    model = MLP(*dims)
    with torch.no_grad():
        model.fc1.weight[0].zero_()
        model.fc2.weight[:, :2] = 0.0
    mg = _graph(model, torch.randn(4, d_in))
    batches = [(torch.randn(3, d_in),), (torch.randn(5, d_in),)]
    mg, info = passes.get_pass("add_natural_sparsity")(mg, {"data": batches})
    inputs = {"fc1": [b[0] for b in batches], "fc2": [torch.relu(model.fc1(b[0])).detach() for b in batches]}
    for target in ("fc1", "fc2"):
        from fxforge.graph.metadata import get_meta

        rec = get_meta(_node(mg, target)).software.get(NaturalSparsityRecord)
        assert rec is not None
        weight = model.get_submodule(target).weight
        assert rec.weight == pytest.approx(float((weight == 0).sum()) / weight.numel())
        zeros = sum(int((t == 0).sum()) for t in inputs[target])
        assert rec.activation == pytest.approx(zeros / sum(t.numel() for t in inputs[target]))
        assert info.layers[target].activation == rec.activation
    assert info.batches == 2


def test_natural_sparsity_counts_pruning_masks_and_refuses_an_empty_data_iterable() -> None:
    mg = _graph(MLP(8, 16, 3), torch.randn(4, 8))
    pruned, _ = prune_transform_pass(mg, {"weight": {"sparsity": 0.5}})
    _, info = passes.add_natural_sparsity_metadata_analysis_pass(pruned)  # the example inputs by default
    assert info.layers["fc1"].weight == 0.5 and info.layers["fc2"].weight == 0.5 and info.batches == 1
    with pytest.raises(PassError, match="add_natural_sparsity_metadata_analysis_pass.*no batch"):
        passes.get_pass("add_natural_sparsity_metadata_analysis_pass")(mg, {"data": []})


@pytest.mark.parametrize("name", ["prune_detach_hook_transform_pass", "prune_detach_hook_analysis_pass",
                                  "hook_inspection_analysis_pass",
                                  "prune_detach_hook", "hook_inspection"])
def test_hook_passes_are_no_ops_that_say_so(name: str, caplog: pytest.LogCaptureFixture) -> None:
    mg, _ = prune_transform_pass(_graph(MLP(8, 16, 3), torch.randn(4, 8)), {"weight": {"sparsity": 0.5}})
    code, state = mg.model.code, {k: v.clone() for k, v in mg.model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="fxforge"):
        out, info = passes.get_pass(name)(mg, {})
    assert out.model.code == code and all(torch.equal(v, out.model.state_dict()[k]) for k, v in state.items())
    assert info.hooks == {} and "no hooks" in info.notice
    assert info.changed in (None, False)
    assert sum("no hooks" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(PassArgsError, match="unknown"):
        passes.get_pass(name)(mg, {"bogus": 1})
