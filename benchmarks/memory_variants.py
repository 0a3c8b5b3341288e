"""The models and training-step variants bench_memory compares: each a zero-argument step plus its modules.

A *step* is forward + loss + backward (the optimizer update is the same for every variant and left out).
Before anything is measured every trainable weight gets an allocated, zeroed ``.grad`` (a loop that zeroes
rather than frees grads), so a step's allocator peak counts activations, gradients in flight, temporaries
and recomputation, never the weights or their grads. The fxforge rows are planned here too, each for a budget
in the pass's units (bytes above the step's start, MB = 2^20).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fxforge import ForgeGraph
from fxforge.models.gpt import GPT, GPTConfig

if TYPE_CHECKING:
    from fxforge.passes.memory.checkpoint_region import Selective

__all__ = ["GPTWithLoss", "PerLayerCheckpoint", "Variant", "checkpoint_every_layer", "checkpoint_pass", "classifier",
           "gpt", "loss_step", "plan_budget", "plan_checkpoints", "plan_equal_memory", "zero_grads"]
MB = 2**20


@dataclass
class Variant:
    """One row: a name, its step and the module(s) whose trainable weights get grads before measuring."""

    name: str
    step: Callable[[], Any]
    modules: list[nn.Module]


class GPTWithLoss(nn.Module):
    """The GPT and its next-token loss (models.gpt.lm_loss) as one module, so a captured graph holds the
    loss (and its saved log-softmax) like the HF classifier's graph does."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)  # lm_loss without its shape check, which fx cannot trace
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class PerLayerCheckpoint(nn.Module):
    """``torch.utils.checkpoint`` around one layer, by hand (non-reentrant, RNG state preserved)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpoint_every_layer(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every encoder layer (HF BERT) or GPT block wrapped in PerLayerCheckpoint."""
    model = copy.deepcopy(model)
    layers = model.model.blocks if isinstance(model, GPTWithLoss) else model.get_submodule("bert.encoder.layer")
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"expected the layers in an nn.ModuleList, got {type(layers).__name__}")
    for i, layer in enumerate(layers):
        layers[i] = PerLayerCheckpoint(layer)
    return model


def classifier(quick: bool) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    """The MiniLM classifier with a batch of 8 x 128 (quick: a tiny random BERT at 2 x 16), in train mode."""
    from fxforge.models.bert import minilm_for_sequence_classification, tiny_bert

    gen = torch.Generator().manual_seed(0)
    if quick:
        model: nn.Module = tiny_bert(num_labels=2, vocab_size=100, num_attention_heads=4, max_position_embeddings=64)
        batch, seq, lo, hi, name = 2, 16, 0, 100, "tiny BERT classifier"
    else:
        model = minilm_for_sequence_classification(num_labels=2, seed=0)
        batch, seq, lo, hi, name = 8, 128, 1000, 30000, "MiniLM-L6 classifier"
    inputs = {"input_ids": torch.randint(lo, hi, (batch, seq), generator=gen),
              "attention_mask": torch.ones(batch, seq, dtype=torch.long),
              "labels": torch.randint(0, 2, (batch,), generator=gen)}
    return model.train(), inputs, f"{name} {batch}x{seq}"


def gpt(quick: bool) -> tuple[GPTWithLoss, dict[str, torch.Tensor], str]:
    """fxforge's zoo GPT (models/gpt.py, GPTConfig's default 4 layers x 128 wide, vocab 256) at T = 1024,
    batch 4, with its loss (quick: 2 layers x 32 wide at T = 32, batch 2)."""
    torch.manual_seed(0)
    if quick:
        cfg = GPTConfig(vocab_size=64, sequence_length=32, n_layer=2, n_head=2, n_embd=32)
        batch = 2
    else:
        cfg = GPTConfig(vocab_size=256, sequence_length=1024)
        batch = 4
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.sequence_length + 1), generator=gen)
    inputs = {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    name = f"GPT {cfg.n_layer}x{cfg.n_embd} T={cfg.sequence_length} batch {batch}"
    return GPTWithLoss(GPT(cfg)).train(), inputs, name


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def loss_step(model: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """forward + loss + backward of ``model(**inputs)`` (a loss tensor or an HF output with ``.loss``)."""

    def step() -> None:
        _loss(model(**inputs)).backward()

    return step


def zero_grads(modules: list[nn.Module]) -> None:
    """Allocate (or zero in place) the grad of every trainable weight, so steps accumulate into held grads."""
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()


def checkpoint_pass() -> Callable[..., Any] | None:
    """fxforge's activation_checkpoint_transform_pass, or None while it does not exist."""
    try:
        from fxforge.passes.memory import activation_checkpoint_transform_pass
    except ImportError:
        return None
    return activation_checkpoint_transform_pass


def plan_checkpoints(graph: ForgeGraph, inputs: dict[str, torch.Tensor], fraction: float
                     ) -> tuple[ForgeGraph, Any, float]:
    """Run the pass at ``fraction`` of the unmodified peak; where no plan reaches it (tiny models), the
    smallest fraction in steps of 0.05 that one does. Returns the graph, the pass's info and the fraction."""
    from fxforge.passes.base import PassError

    ckpt = checkpoint_pass()
    assert ckpt is not None
    while True:
        try:
            out, info = ckpt(graph, {"fraction": fraction, "data": inputs})  # a transform returns a copy
            return out.train(), info, fraction
        except PassError:
            if fraction >= 1.0:
                raise
            fraction = round(min(1.0, fraction + 0.05), 2)


def plan_budget(graph: ForgeGraph, inputs: dict[str, torch.Tensor], share: float, reference_peak: int
                ) -> tuple[ForgeGraph, Any, float]:
    """Plan ``graph`` for ``budget_mb`` = share x a MEASURED reference peak (bytes above the step's start, the
    quantity the pass estimates); where no plan reaches it (tiny models), the share rises in steps of 0.05 (a
    budget at or above the graph's own peak plans nothing, so this ends). Returns the graph, the info, the share."""
    from fxforge.passes.base import PassError

    ckpt = checkpoint_pass()
    assert ckpt is not None
    while True:
        try:
            out, info = ckpt(graph, {"budget_mb": share * reference_peak / MB, "data": inputs})
            return out.train(), info, share
        except PassError:
            share = round(share + 0.05, 3)


How = Literal["estimate", "measured", "smallest"]  # how plan_equal_memory plans


def plan_equal_memory(graph: ForgeGraph, inputs: dict[str, torch.Tensor], reference: str, peak: int,
                      margin: float, selective: Selective = False,
                      how: How = "estimate"
                      ) -> tuple[ForgeGraph | None, dict[str, Any]]:
    """Plan ``graph`` to run within another variant's MEASURED ``peak``, to time both at the same memory
    (``selective``: the pass's selective mode). ``how``: "estimate" plans for budget_mb = (1 - margin) x peak on
    the pass's estimate; "measured" the same with ``measure`` (the pass fits it on the allocator's measured peak of
    its candidate plans); "smallest" plans for the smallest peak the planner reaches on ``inputs``, kept only if
    that is within the budget. No share is raised here: where no plan fits, the graph is None and the record holds
    the smallest peak reachable (the planner's, or the one the pass reports when refusing)."""
    from fxforge.passes.base import PassError

    ckpt = checkpoint_pass()
    assert ckpt is not None
    budget_mb = (1.0 - margin) * peak / MB
    record: dict[str, Any] = {"reference": reference, "reference_peak_bytes": peak, "share": 1.0 - margin,
                              "selective": selective, "how": how}

    args = {"data": inputs, "selective": selective, "measure": how == "measured"}
    if how == "smallest":  # the planner's smallest peak on these inputs, in bytes (+1: MB and back may round down)
        from fxforge.graph.inputs import ExampleInputs
        from fxforge.passes.memory import checkpoint_plan as planner  # (this module has its own plan_checkpoints)
        from fxforge.passes.propagate import flat_inputs

        flat = flat_inputs(graph.model, ExampleInputs.coerce(inputs))
        least = planner.plan_checkpoints(planner.graph_costs(graph.model, flat, selective=selective), None)[1]
        if least > budget_mb * MB:
            record.update(budget_bytes=int(budget_mb * MB), unreachable=True, smallest_reachable_bytes=least)
            return None, record
        budget_mb = (least + 1) / MB
    try:
        out, info = ckpt(graph, {**args, "budget_mb": budget_mb})
    except PassError as exc:
        found = re.search(r"(?:reaches|measured), ([0-9.]+) MB", str(exc))
        record.update(budget_bytes=int(budget_mb * MB), unreachable=True,
                      smallest_reachable_bytes=float(found.group(1)) * MB if found else None)
        return None, record
    record.update(budget_bytes=info.budget_bytes, planned_peak_bytes=info.planned_peak_bytes,
                  baseline_peak_bytes=info.baseline_peak_bytes, segments=info.segments,
                  recompute_fraction=info.recompute_fraction, measured_peak_bytes=info.measured_peak_bytes,
                  measured_plans=info.measured_plans)
    return out.train(), record
