"""Pickle-free checkpoints: exact round trips, integrity checks, and an allowlist that edits cannot escape."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn as nn
from conftest import bert_inputs, make_agru, make_gpt, make_tiny_bert

from fxforge import ForgeGraph, passes
from fxforge.graph import targets
from fxforge.graph.checkpoint import load_checkpoint, save_checkpoint
from fxforge.graph.metadata import get_meta, has_meta
from fxforge.graph.targets import CheckpointError

FILES = {"graph.json", "metadata.json", "weights.safetensors", "example_inputs.safetensors", "manifest.json",
         "reference_outputs.safetensors"}  # eval-mode graphs with example inputs record their outputs


class ConvNet(nn.Module):
    """Conv, batch norm, dropout, linear, a buffer and a tensor constant: the fx flavour."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Sequential(nn.Linear(4 * 6 * 6, 16), nn.GELU(), nn.Linear(16, 5))
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("cache", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        y = self.drop(y.flatten(1)) * self.scale + torch.tensor([0.25])
        return self.head(y).softmax(-1)[..., 1:]


class Spectral(nn.Module):
    """rfft → complex filter (a complex parameter and a complex scalar) → irfft, with tied weights."""

    def __init__(self, tokens: int = 12, channels: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, channels)
        self.filt = nn.Parameter(0.1 * torch.randn(tokens // 2 + 1, channels, dtype=torch.complex64))
        self.norm = nn.LayerNorm(channels)
        self.out = nn.Linear(channels, 20, bias=False)
        self.out.weight = self.emb.weight  # tied, as in GPT's lm_head / wte

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        spec = torch.fft.rfft(x, dim=1) * self.filt * (1 + 0.5j)
        y = torch.fft.irfft(spec, n=x.shape[1], dim=1)
        return self.out(self.norm(x + y))


def _with_metadata(mg: ForgeGraph) -> ForgeGraph:
    mg, _ = passes.init_metadata_analysis_pass(mg)
    mg, _ = passes.add_common_metadata_analysis_pass(mg)
    return mg


def _meta(mg: ForgeGraph) -> dict[str, Any]:
    return {n.name: get_meta(n).to_json() for n in mg.nodes if has_meta(n)}


def _node_table(mg: ForgeGraph) -> list[tuple[str, str, Any]]:
    return [(n.name, n.op, n.target if n.op == "call_function" else str(n.target)) for n in mg.nodes]


def assert_same_graph(a: ForgeGraph, b: ForgeGraph) -> None:
    """Everything a round trip must keep, except outputs (compared by each test)."""
    assert _node_table(a) == _node_table(b)
    assert _meta(a) == _meta(b) and _meta(a)
    assert a.frontend == b.frontend and a.capture_notes == b.capture_notes and a.history == b.history
    assert {n: m.training for n, m in a.model.named_modules()} == {n: m.training for n, m in b.model.named_modules()}
    types_a, types_b = ({n: type(m) for n, m in g.model.named_modules() if n} for g in (a, b))
    assert types_a == types_b and type(a.model).__name__ == type(b.model).__name__
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert {n: p.requires_grad for n, p in pa.items()} == {n: p.requires_grad for n, p in pb.items()}
    sa, sb = a.model.state_dict(keep_vars=True), b.model.state_dict(keep_vars=True)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert dict(a.model.named_buffers()).keys() == dict(b.model.named_buffers()).keys()


def _close(x: Any, y: Any) -> None:
    if isinstance(x, torch.Tensor):
        assert x.shape == y.shape and x.dtype == y.dtype and (x - y).abs().max() <= 1e-6
    else:
        assert type(x) is type(y)
        for k in x.keys():
            _close(x[k], y[k])


@pytest.fixture(scope="module")
def ckpt_bert() -> ForgeGraph:
    torch.manual_seed(0)
    return _with_metadata(ForgeGraph(make_tiny_bert(), hf_input_names=["input_ids", "attention_mask", "labels"]))


@pytest.fixture
def ckpt_convnet() -> ForgeGraph:
    model = ConvNet().eval()
    model.conv.weight.requires_grad_(False)
    return _with_metadata(ForgeGraph(model, example_inputs=(torch.randn(2, 3, 6, 6),), frontend="fx"))


@pytest.fixture
def ckpt_saved(ckpt_convnet: ForgeGraph, tmp_path: Path) -> Path:
    return ckpt_convnet.export(tmp_path / "ckpt")


# -- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_convnet_round_trip(frontend: str, tmp_path: Path) -> None:
    model = ConvNet().eval()
    model.conv.weight.requires_grad_(False)
    x = torch.randn(2, 3, 6, 6)
    mg = _with_metadata(ForgeGraph(model, example_inputs=(x,), frontend=frontend))
    path = mg.export(tmp_path / "convnet")
    assert path == tmp_path / "convnet" and {p.name for p in path.iterdir()} == FILES
    back = ForgeGraph.from_checkpoint(path)
    assert_same_graph(mg, back)
    assert not back.model.get_submodule("conv").weight.requires_grad
    assert torch.equal(back.example_inputs.args[0], x)
    _close(mg(torch.ones(3, 3, 6, 6)), back(torch.ones(3, 3, 6, 6)))
    _close(mg(x), back(x))


def test_bert_round_trip_through_export_frontend(ckpt_bert: ForgeGraph, tmp_path: Path) -> None:
    back = load_checkpoint(save_checkpoint(ckpt_bert, tmp_path / "bert"))
    assert_same_graph(ckpt_bert, back)
    assert back.frontend == "export" and len(back.history) == 2
    assert back.example_inputs.kwargs.keys() == {"input_ids", "attention_mask", "labels"}
    inputs = bert_inputs()
    got, want = back.eval()(**inputs), ckpt_bert.eval()(**inputs)
    assert type(got).__name__ == "SequenceClassifierOutput"
    _close(got, want)


FRESH_LOAD = """
import sys, safetensors.torch
from fxforge import ForgeGraph
imported = "transformers.modeling_outputs" in sys.modules
mg = ForgeGraph.from_checkpoint(sys.argv[1]).eval()
inputs = safetensors.torch.load_file(sys.argv[2])
want = inputs.pop("want")
out = mg(**inputs)
assert type(out).__name__ == "SequenceClassifierOutput", type(out)
assert (out.logits - want).abs().max() <= 1e-6
print("ok", imported)
"""


def test_bert_checkpoint_loads_in_a_fresh_process(ckpt_bert: ForgeGraph, tmp_path: Path) -> None:
    """The HF output type is re-imported by name from transformers (allowlisted prefix) on load."""
    path = ckpt_bert.export(tmp_path / "bert.v1")
    inputs = bert_inputs()
    want = ckpt_bert.eval()(**inputs).logits.detach()
    safetensors.torch.save_file({**inputs, "want": want}, tmp_path / "io.safetensors")
    run = subprocess.run([sys.executable, "-c", FRESH_LOAD, str(path), str(tmp_path / "io.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_fft_model_with_complex_weights_and_tied_embedding(frontend: str, tmp_path: Path) -> None:
    idx = torch.randint(0, 20, (2, 12))
    mg = _with_metadata(ForgeGraph(Spectral().eval(), example_inputs=(idx,), frontend=frontend))
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "fft"))
    assert_same_graph(mg, back)
    _close(mg(idx), back(idx))
    assert back.model.get_submodule("out").weight is back.model.get_submodule("emb").weight
    assert back.model.get_parameter("filt").dtype == torch.complex64
    graph = json.loads((tmp_path / "fft" / "graph.json").read_text())
    shape = list(mg.model.get_parameter("emb.weight").shape)
    assert {"name": "out.weight", "kind": "parameter", "requires_grad": True, "alias_of": "emb.weight",
            "shape": shape, "dtype": "float32"} in graph["tensors"]


@pytest.mark.parametrize("name,frontend", [("gpt-attn", "fx"), ("gpt-afno", "export"), ("agru", "auto")])
def test_model_zoo_round_trip(name: str, frontend: str, tmp_path: Path) -> None:
    """GPT (rotary attention; AFNO with rfft/irfft) and A-GRU: outputs, metadata and names survive."""
    model = make_agru() if name == "agru" else make_gpt(name.split("-")[1])
    x = torch.randn(2, 5, 8) if name == "agru" else torch.randint(0, 64, (2, 16))
    mg = _with_metadata(ForgeGraph(model, example_inputs=(x,), frontend=frontend))
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / f"{name}.ckpt"))
    assert_same_graph(mg, back)
    _close(mg(x), back(x))


def test_shared_modules_buffers_and_constants_stay_shared(tmp_path: Path) -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    gm.register_buffer("table", torch.arange(4.0))
    gm.twin = gm.get_submodule("0")  # the same Linear under a second path
    gm.extra = nn.Module()
    gm.extra.register_buffer("table_alias", gm.table, persistent=False)
    gm.const = gm.extra.const = torch.ones(2)
    back = ForgeGraph.from_checkpoint(ForgeGraph.from_parts(gm, "fx").export(tmp_path / "shared"))
    m = back.model
    assert m.twin is m.get_submodule("0") and m.extra.table_alias is m.table and m.extra.const is m.const
    assert "table_alias" in m.extra._non_persistent_buffers_set and torch.equal(m.const, torch.ones(2))
    x = torch.randn(2, 3)
    assert torch.equal(back(x), gm(x))


def test_train_mode_and_per_module_flags_survive(ckpt_convnet: ForgeGraph, tmp_path: Path) -> None:
    ckpt_convnet.train()
    ckpt_convnet.model.get_submodule("bn").eval()
    back = ForgeGraph.from_checkpoint(ckpt_convnet.export(tmp_path / "train"))
    assert back.model.training and not back.model.get_submodule("bn").training
    assert_same_graph(ckpt_convnet, back)


def test_export_overwrites_a_checkpoint_but_not_other_directories(ckpt_convnet: ForgeGraph, tmp_path: Path) -> None:
    path = ckpt_convnet.export(tmp_path / "again")
    ckpt_convnet.export(path)
    assert {p.name for p in tmp_path.iterdir()} == {"again"}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="notes.txt"):
        ckpt_convnet.export(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", ["ckpt.v1.2", "model.safetensors", "a.b/c.d.e"])
def test_paths_with_dots(ckpt_convnet: ForgeGraph, tmp_path: Path, name: str) -> None:
    path = ckpt_convnet.export(str(tmp_path / name))
    assert path == tmp_path / name and path.is_dir() and {p.name for p in path.iterdir()} == FILES
    back = ForgeGraph.from_checkpoint(str(path))
    x = torch.randn(1, 3, 6, 6)
    _close(ckpt_convnet(x), back(x))


# -- integrity --------------------------------------------------------------------------------------------
def _flip_byte(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["weights.safetensors", "graph.json", "metadata.json", "example_inputs.safetensors"])
def test_tampered_file_is_named(ckpt_saved: Path, name: str) -> None:
    _flip_byte(ckpt_saved / name)
    with pytest.raises(CheckpointError, match=rf"{name}: size/SHA-256 does not match manifest.json"):
        ForgeGraph.from_checkpoint(ckpt_saved)


@pytest.mark.parametrize("name", ["weights.safetensors", "graph.json", "metadata.json", "manifest.json"])
def test_missing_file_is_named(ckpt_saved: Path, name: str) -> None:
    (ckpt_saved / name).unlink()
    with pytest.raises(CheckpointError, match=rf"{name}: missing"):
        ForgeGraph.from_checkpoint(ckpt_saved)


def test_missing_directory_and_corrupt_manifest(ckpt_saved: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        ForgeGraph.from_checkpoint(tmp_path / "nope")
    (ckpt_saved / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: unreadable or corrupt"):
        ForgeGraph.from_checkpoint(ckpt_saved)


def _rewrite(path: Path, name: str, data: bytes) -> None:
    """Replace a file and update the manifest, as an attacker (or a careless edit) would."""
    (path / name).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name,data,message", [
    ("graph.json", b'{"format": "fxforge-checkpoint"', "graph.json: unreadable file"),
    ("weights.safetensors", b"\x00" * 64, "weights.safetensors: unreadable file"),
    ("metadata.json", b'{"schema_version": 1, "nodes": {"nope": {}}}', "metadata.json: metadata for unknown node"),
])
def test_corrupt_content_with_matching_hash_is_named(ckpt_saved: Path, name: str, data: bytes, message: str) -> None:
    _rewrite(ckpt_saved, name, data)
    with pytest.raises(CheckpointError, match=message):
        ForgeGraph.from_checkpoint(ckpt_saved)


# -- the allowlist holds against hand-edited graphs ---------------------------------------------------------
def _edit_graph(path: Path, edit: Any) -> None:
    graph = json.loads((path / "graph.json").read_text())
    edit(graph)
    _rewrite(path, "graph.json", json.dumps(graph).encode())


def _node(graph: dict[str, Any], op: str) -> dict[str, Any]:
    return next(n for n in graph["nodes"] if n["op"] == op)


@pytest.fixture
def ckpt_spies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any call to the functions a malicious checkpoint would like to reach."""
    calls: list[str] = []
    for owner, attr in [(os, "system"), (builtins, "eval"), (torch, "save"), (torch, "load")]:
        monkeypatch.setattr(owner, attr, lambda *a, _n=attr, **k: calls.append(_n))
    return calls


@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "torch.save", "subprocess.run",
                                    "torch.ops.aten.from_file.default", "operator.methodcaller"])
def test_graph_naming_a_function_outside_the_allowlist(ckpt_saved: Path, ckpt_spies: list[str], target: str) -> None:
    def edit(graph: dict[str, Any]) -> None:
        node = _node(graph, "call_function")
        node["target"], node["args"], node["kwargs"] = target, ["echo pwned > /tmp/fxforge_pwned"], {}

    _edit_graph(ckpt_saved, edit)
    with pytest.raises(CheckpointError, match=rf"graph.json: node '\w+' \(call_function '{target}'\)") as err:
        ForgeGraph.from_checkpoint(ckpt_saved)
    assert "not" in str(err.value) and ckpt_spies == []


@pytest.mark.parametrize("op,field,value,message", [
    ("call_method", "target", "numpy", "not an allowed Tensor method"),
    ("call_module", "target", 'head") or __import__("os").system("id', "bad module/attribute path"),
    ("get_attr", "target", "__class__", "bad module/attribute path"),
    ("get_attr", "target", "training", "not a stored tensor or module"),
    ("call_function", "name", "x = __import__('os')", "malformed node"),
    ("call_function", "name", "torch", "name is taken or reserved"),
    ("placeholder", "target", "x=print('hi')", "bad placeholder target"),
    ("output", "target", "os.system", "bad output target"),
])
def test_other_hand_edits_are_refused(ckpt_saved: Path, ckpt_spies: list[str], op: str, field: str, value: str,
                                      message: str) -> None:
    def edit(graph: dict[str, Any]) -> None:
        node = next((n for n in graph["nodes"] if n["op"] == op), None) or _node(graph, "call_function")
        node["op"] = op
        node[field] = value

    _edit_graph(ckpt_saved, edit)
    with pytest.raises(CheckpointError, match=message):
        ForgeGraph.from_checkpoint(ckpt_saved)
    assert ckpt_spies == []


@pytest.mark.parametrize("cls", ["transformers.models.bert.modeling_bert.BertSelfAttention", "os.Mystery"])
def test_unknown_module_class_in_checkpoint(ckpt_saved: Path, cls: str) -> None:
    _edit_graph(ckpt_saved, lambda g: g["modules"][0].update({"class": cls}))
    with pytest.raises(CheckpointError, match=rf"graph.json: module class '{cls}' is not in the checkpoint allowlist"):
        ForgeGraph.from_checkpoint(ckpt_saved)


def test_pytree_output_type_outside_the_allowlist(ckpt_bert: ForgeGraph, tmp_path: Path) -> None:
    path = ckpt_bert.export(tmp_path / "bert")
    _edit_graph(path, lambda g: g["codegen"]["out_spec"].update({"output": "os.PathLike"}))
    with pytest.raises(CheckpointError, match="graph.json: pytree type 'os.PathLike' is not in the checkpoint"):
        ForgeGraph.from_checkpoint(path)


def test_weights_must_match_the_module_tree(ckpt_saved: Path) -> None:
    _edit_graph(ckpt_saved, lambda g: g.update(tensors=[t for t in g["tensors"] if t["name"] != "head.0.bias"]))
    with pytest.raises(CheckpointError, match="weights.safetensors: holds tensors graph.json does not mention"):
        ForgeGraph.from_checkpoint(ckpt_saved)


# -- saving refuses what loading could not resolve ---------------------------------------------------------
class Custom(nn.Module):
    """A user layer kept whole by the fx frontend."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.custom = Custom()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.custom(x) + 1


@pytest.mark.usefixtures("restore_registries")
def test_unregistered_module_refused_at_export_then_registered(tmp_path: Path) -> None:
    x = torch.randn(2, 4)
    mg = ForgeGraph(WithCustom(), example_inputs=(x,), frontend="fx", leaf_modules=[Custom])
    with pytest.raises(CheckpointError, match=r"module 'custom'.*Custom is not in the checkpoint.*register_module"):
        mg.export(tmp_path / "custom")
    assert not (tmp_path / "custom").exists() and list(tmp_path.iterdir()) == []
    targets.register_module(Custom, lambda m: {"n": m.n}, lambda c: Custom(**c), name="tests.Custom")
    back = ForgeGraph.from_checkpoint(mg.export(tmp_path / "custom"))
    assert type(back.model.custom) is Custom and torch.equal(back(x), mg(x))
