"""Ops outside aten/prims/fxforge that checkpoints may name: HF's MoE op round-trips with no registration,
and only because it is individually known (name, exact schema, implementation), never by its namespace."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import rehash_manifest
from hf_tiny import VOCAB, hf_inputs

from fxforge import ExampleInputs, ForgeGraph
from fxforge.graph import known_ops, targets
from fxforge.graph.targets import CheckpointError

GROUPED_MM = "torch.ops.transformers.grouped_mm_fallback.default"
MOE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
       "vocab_size": VOCAB, "max_position_embeddings": 64, "hidden_size": 32, "intermediate_size": 64}


def _mixtral() -> nn.Module:
    import transformers as T

    return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, **MOE))


def _qwen3_moe() -> nn.Module:
    import transformers as T

    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, **MOE))


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_moe_checkpoint_round_trips_exactly(build: Callable[[], nn.Module], tmp_path: Path) -> None:
    torch.manual_seed(0)
    mg = ForgeGraph(build().eval(), hf_input_names=["input_ids", "attention_mask"])
    assert GROUPED_MM in {f"torch.ops.{n.target}" for n in mg.nodes if n.op == "call_function"}
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "moe"))
    mg.eval()
    back.eval()
    cases = [hf_inputs("llama", b, s, left_pad=p) for b, s in [(3, 11), (1, 7)] for p in (False, True)]
    for inputs in cases:
        inputs.pop("labels")
        with torch.no_grad():
            got, want = back(**inputs).logits, mg(**inputs).logits
        assert got.shape == (*inputs["input_ids"].shape, VOCAB)
        assert torch.equal(got, want), {k: tuple(v.shape) for k, v in inputs.items()}


def test_every_known_op_matches_its_live_schema_and_is_pure() -> None:
    assert known_ops.KNOWN_OPS, "the table lists HF's MoE op"
    for qualified, known in known_ops.KNOWN_OPS.items():
        namespace, rest = qualified.split("::")
        op, overload = rest.split(".")
        name = f"torch.ops.{namespace}.{op}.{overload}"
        resolved = targets.resolve_function(name)
        assert str(resolved._schema) == known.schema
        assert not any(a.alias_info for a in (*resolved._schema.arguments, *resolved._schema.returns))
        assert targets._global_effect(resolved) is None
        assert targets.function_name(resolved) == name
        assert known.why_pure and known.module and known.implementation.startswith(known.module + ".")


@pytest.mark.parametrize("name", [
    "torch.ops.transformers.no_such_op.default",  # HF's namespace does not make an op known
    "torch.ops.transformers.grouped_mm_fallback_backward.default",  # a real HF op, but not in the table
    "torch.ops.transformers_msa.sparse_atten.default",  # a real HF op that loads kernels from the Hub
    "torch.ops.evil.system.default",
])
def test_ops_outside_the_table_are_refused(name: str) -> None:
    with pytest.raises(CheckpointError, match="not one of the ops fxforge knows") as err:
        targets.resolve_function(name)
    assert repr(name) in str(err.value) and "register_op_namespace" in str(err.value)


@torch.library.custom_op("fxforge_known_custom::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    """A pure custom op of this test module, audited by the tests that add it to the table."""
    return x * 2


DOUBLE = "fxforge_known_custom::double(Tensor x) -> Tensor"


@pytest.fixture
def test_library() -> Iterator[torch.library.Library]:
    """A throw-away op namespace ``fxforge_known_test`` with an identity op and an in-place op."""
    lib = torch.library.Library("fxforge_known_test", "DEF")
    lib.define("ident(Tensor x) -> Tensor")
    lib.impl("ident", lambda x: x.clone(), "CompositeExplicitAutograd")
    lib.define("scale_(Tensor(a!) x, float s) -> Tensor(a!)")
    lib.impl("scale_", lambda x, s: x.mul_(s), "CompositeExplicitAutograd")
    yield lib
    lib._destroy()


def _know(monkeypatch: pytest.MonkeyPatch, qualified: str, schema: str,
          implementation: str = f"{__name__}._double") -> None:
    entry = known_ops.KnownOp(schema=schema, why_pure="test", module=__name__, implementation=implementation)
    monkeypatch.setattr(known_ops, "KNOWN_OPS", {**known_ops.KNOWN_OPS, qualified: entry})


def test_an_audited_custom_op_resolves_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "torch.ops.fxforge_known_custom.double.default"
    with pytest.raises(CheckpointError, match="not one of the ops fxforge knows"):
        targets.resolve_function(name)
    _know(monkeypatch, "fxforge_known_custom::double.default", DOUBLE)
    op = targets.resolve_function(name)
    assert op is torch.ops.fxforge_known_custom.double.default and targets.function_name(op) == name
    assert targets.resolve_function(name[: -len(".default")]) is torch.ops.fxforge_known_custom.double


def test_a_known_name_with_another_live_schema_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = "fxforge_known_custom::double(Tensor x, int k) -> Tensor"
    _know(monkeypatch, "fxforge_known_custom::double.default", recorded)
    with pytest.raises(CheckpointError, match="schema") as err:
        targets.resolve_function("torch.ops.fxforge_known_custom.double.default")
    assert recorded in str(err.value) and DOUBLE in str(err.value)
    with pytest.raises(CheckpointError, match="schema"):  # saving checks the same rule
        targets.function_name(torch.ops.fxforge_known_custom.double.default)


def test_a_known_mutating_op_is_refused(monkeypatch: pytest.MonkeyPatch,
                                        test_library: torch.library.Library) -> None:
    schema = "fxforge_known_test::scale_(Tensor(a!) x, float s) -> Tensor(a!)"
    _know(monkeypatch, "fxforge_known_test::scale_.default", schema)
    with pytest.raises(CheckpointError, match="writes to or aliases"):
        targets.resolve_function("torch.ops.fxforge_known_test.scale_.default")


def test_a_known_name_registered_by_other_code_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                          test_library: torch.library.Library) -> None:
    """Same name and schema as the table's entry, but not the implementation it audited."""
    _know(monkeypatch, "fxforge_known_test::ident.default", "fxforge_known_test::ident(Tensor x) -> Tensor")
    with pytest.raises(CheckpointError, match=f"not registered by {__name__}._double"):
        targets.resolve_function("torch.ops.fxforge_known_test.ident.default")
    _know(monkeypatch, "fxforge_known_custom::double.default", DOUBLE, implementation=f"{__name__}._other")
    with pytest.raises(CheckpointError, match=f"here it runs {__name__}._double"):
        targets.resolve_function("torch.ops.fxforge_known_custom.double.default")


def test_a_packet_name_needs_every_overload_known(monkeypatch: pytest.MonkeyPatch) -> None:
    _know(monkeypatch, "fxforge_known_custom::double.default", DOUBLE)
    lib = torch.library.Library("fxforge_known_custom", "FRAGMENT")
    try:
        lib.define("double.twice(Tensor x, Tensor y) -> Tensor")
        with pytest.raises(CheckpointError, match="double.twice is not one of the ops fxforge knows"):
            targets.resolve_function("torch.ops.fxforge_known_custom.double")
        assert targets.resolve_function("torch.ops.fxforge_known_custom.double.default") is not None
    finally:
        lib._destroy()


def test_a_registered_namespace_still_trusts_every_op(restore_registries: None,
                                                      test_library: torch.library.Library) -> None:
    targets.register_op_namespace("fxforge_known_test")
    op = targets.resolve_function("torch.ops.fxforge_known_test.ident.default")
    assert op is torch.ops.fxforge_known_test.ident.default


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter, where transformers is not imported yet."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def test_loading_imports_only_the_tables_module() -> None:
    out = _fresh_python("""
        import sys
        from fxforge.graph import targets
        assert "transformers" not in sys.modules
        for name in ("torch.ops.transformers.no_such_op.default", "torch.ops.evil.system.default"):
            try:
                targets.resolve_function(name)
            except targets.CheckpointError:
                pass
        assert "transformers" not in sys.modules, "an unknown name imported something"
        op = targets.resolve_function("torch.ops.transformers.grouped_mm_fallback.default")
        new = sorted(m for m in sys.modules if m.startswith("transformers.integrations"))
        print(op, new)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "transformers.grouped_mm_fallback.default" in out.stdout
    assert "'transformers.integrations.moe'" in out.stdout


def test_a_known_op_without_its_library_is_a_clear_error() -> None:
    out = _fresh_python("""
        import sys
        sys.modules["transformers"] = None  # as if transformers were not installed
        from fxforge.graph import targets
        try:
            targets.resolve_function("torch.ops.transformers.grouped_mm_fallback.default")
        except targets.CheckpointError as exc:
            print("refused:", exc)
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout and "pip install transformers" in out.stdout


class _CallsIdent(nn.Module):
    """Linear then the test library's ``ident`` op: a user kernel trusted through register_op_namespace."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fxforge_known_test.ident.default(self.fc(x))


def _graph_doc(path: Path) -> dict:
    return json.loads((path / "graph.json").read_text())


def test_checkpoints_record_and_check_the_schema_of_ops_outside_aten(
        restore_registries: None, tmp_path: Path) -> None:
    targets.register_op_namespace("fxforge_known_test")
    x = torch.randn(5, 4)
    with _ident_library("ident(Tensor x) -> Tensor", lambda x: x.clone()):
        mg = ForgeGraph(_CallsIdent().eval(), example_inputs=ExampleInputs((torch.randn(2, 4),), {}),
                        frontend="fx")
        path = mg.export(tmp_path / "ident")
        nodes = [n for n in _graph_doc(path)["nodes"] if n["op"] == "call_function"]
        recorded = {n["target"]: n.get("schema") for n in nodes}
        assert recorded["torch.ops.fxforge_known_test.ident.default"] == \
            "fxforge_known_test::ident(Tensor x) -> Tensor"
        assert all(s is None for t, s in recorded.items() if not t.startswith("torch.ops.fxforge_known_test."))
        assert torch.equal(ForgeGraph.from_checkpoint(path)(x), mg(x))
        old = _copy_without_schemas(path, tmp_path / "old")  # as written before schemas were recorded
        assert torch.equal(ForgeGraph.from_checkpoint(old)(x), mg(x))
    # the kernel changed its signature since the checkpoint was saved: refused, not called with old arguments
    with _ident_library("ident(Tensor x, int k=0) -> Tensor", lambda x, k=0: x + k):
        with pytest.raises(CheckpointError, match=r"recorded schema .*ident\(Tensor x\) -> Tensor.*int k"):
            ForgeGraph.from_checkpoint(path)


@contextlib.contextmanager
def _ident_library(schema: str, impl: Callable[..., torch.Tensor]) -> Iterator[None]:
    lib = torch.library.Library("fxforge_known_test", "DEF")
    try:
        lib.define(schema)
        lib.impl("ident", impl, "CompositeExplicitAutograd")
        yield
    finally:
        lib._destroy()


def _copy_without_schemas(path: Path, dest: Path) -> Path:
    shutil.copytree(path, dest)
    doc = _graph_doc(dest)
    for node in doc["nodes"]:
        node.pop("schema", None)
    (dest / "graph.json").write_text(json.dumps(doc))
    rehash_manifest(dest)
    return dest


@pytest.mark.parametrize("schema", ["fxforge_known_custom::double(Tensor y) -> Tensor", 7, None, ""])
def test_a_tampered_recorded_schema_is_refused(schema: object, monkeypatch: pytest.MonkeyPatch) -> None:
    _know(monkeypatch, "fxforge_known_custom::double.default", DOUBLE)
    op = torch.ops.fxforge_known_custom.double.default
    assert known_ops.op_schema(op) == DOUBLE
    targets.check_op_schema(op, DOUBLE)
    with pytest.raises(CheckpointError, match="recorded schema"):
        targets.check_op_schema(op, schema)
    targets.check_op_schema(torch.ops.aten.add.Tensor, None)  # aten ops record none
    with pytest.raises(CheckpointError, match="recorded schema"):
        targets.check_op_schema(torch.ops.aten.add.Tensor, "aten::add.Tensor(Tensor self) -> Tensor")
