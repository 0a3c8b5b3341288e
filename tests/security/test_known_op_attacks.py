"""Hostile MoE checkpoints: a checkpoint may name HF's grouped matmul because fxforge audited that op, and
nothing else outside aten/prims/fxforge; naming an op never imports what the checkpoint names."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_helpers import edit_json, fresh_copy

from fxforge import CheckpointError, ForgeGraph
from fxforge.graph import known_ops, targets

GROUPED_MM = "torch.ops.transformers.grouped_mm_fallback.default"


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral (its experts run HF's grouped_mm_fallback op) exported once per module."""
    import transformers as T

    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=100, max_position_embeddings=64)).eval()
    mg = ForgeGraph(model, hf_input_names=["input_ids", "attention_mask"])
    return mg.export(tmp_path_factory.mktemp("moe") / "mixtral")


@pytest.fixture
def ckpt(moe_ckpt: Path, tmp_path: Path) -> Path:
    return fresh_copy(moe_ckpt, tmp_path)


def _retarget(path: Path, target: str) -> list[str]:
    """Point every grouped-matmul node of the checkpoint at ``target``; returns the nodes' names."""
    names: list[str] = []

    def edit(g: dict[str, Any]) -> None:
        for node in g["nodes"]:
            if node["target"] == GROUPED_MM:
                node["target"] = target
                names.append(node["name"])
    edit_json(path, "graph.json", edit)
    assert names
    return names


def test_the_pristine_moe_checkpoint_loads(ckpt: Path) -> None:
    back = ForgeGraph.from_checkpoint(ckpt)
    assert sum(n.target is torch.ops.transformers.grouped_mm_fallback.default for n in back.nodes) >= 2


@pytest.mark.parametrize("target", [
    "torch.ops.transformers.grouped_mm_fallback_backward.default",  # HF's, real, but not audited
    "torch.ops.transformers.no_such_op.default",
    "torch.ops.transformers_msa.sparse_atten.default",  # HF's op that fetches a kernel from the Hub
    "torch.ops.transformers.grouped_mm_fallback.not_an_overload",
])
def test_other_transformers_ops_are_refused_naming_the_node(ckpt: Path, target: str) -> None:
    first = _retarget(ckpt, target)[0]
    with pytest.raises(CheckpointError, match=rf"node '{first}'.*{target}"):
        ForgeGraph.from_checkpoint(ckpt)


def test_a_changed_live_schema_is_refused(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the installed transformers changed the op's signature since fxforge audited it."""
    entry = known_ops.KNOWN_OPS["transformers::grouped_mm_fallback.default"]
    audited = entry.schema.replace("Tensor offs)", "Tensor offs, bool transposed)")
    changed = {"transformers::grouped_mm_fallback.default": known_ops.KnownOp(
        schema=audited, why_pure=entry.why_pure, module=entry.module, implementation=entry.implementation)}
    monkeypatch.setattr(known_ops, "KNOWN_OPS", changed)
    with pytest.raises(CheckpointError, match="live schema .* differs from the audited schema") as err:
        ForgeGraph.from_checkpoint(ckpt)
    assert audited in str(err.value) and entry.schema in str(err.value)


def test_an_unknown_namespace_imports_nothing(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = tmp_path / "pwned"
    (tmp_path / "evil_planted.py").write_text(f"import pathlib\npathlib.Path({str(canary)!r}).touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    _retarget(ckpt, "torch.ops.evil_planted.run.default")
    with pytest.raises(CheckpointError, match="not one of the ops fxforge knows"):
        ForgeGraph.from_checkpoint(ckpt)
    assert not canary.exists() and set(sys.modules) == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(namespace=st.sampled_from(["transformers", "transformers_msa", "evil_planted", "os", "builtins"]),
       op=st.from_regex(r"\A[a-z_][a-z0-9_]{0,20}\Z"), overload=st.sampled_from(["", ".default", ".out"]))
def test_no_name_outside_the_table_resolves_or_imports(namespace: str, op: str, overload: str) -> None:
    name = f"torch.ops.{namespace}.{op}{overload}"
    before = set(sys.modules)
    try:
        resolved = targets.resolve_function(name)
    except CheckpointError:
        resolved = None
    if resolved is not None:  # only the audited op resolves
        assert f"{namespace}::{op}.default" in known_ops.KNOWN_OPS
    assert set(sys.modules) <= before | {"transformers.integrations.moe"}


@pytest.mark.parametrize("schema", ["transformers::grouped_mm_fallback(Tensor input, Tensor weight) -> Tensor",
                                    None, 3, ["x"], ""])
def test_a_tampered_recorded_schema_is_refused(ckpt: Path, schema: Any) -> None:
    recorded: list[Any] = []

    def edit(g: dict[str, Any]) -> None:
        node = next(n for n in g["nodes"] if n["target"] == GROUPED_MM)
        recorded.append(node["schema"])
        node["schema"] = schema
    edit_json(ckpt, "graph.json", edit)
    assert recorded == [known_ops.KNOWN_OPS["transformers::grouped_mm_fallback.default"].schema]
    with pytest.raises(CheckpointError, match="recorded schema .* does not match the live op"):
        ForgeGraph.from_checkpoint(ckpt)
