"""Property: any mutation of a real checkpoint's JSON (manifest recomputed) loads to a graph or fails with
CheckpointError — never runs code (a canary file), never opens a file outside the directory, never
raises anything else. ``FXFORGE_FUZZ_EXAMPLES=5000`` runs a bigger campaign by hand."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from security_helpers import export_ckpt, mutate_json, remanifest  # noqa: F401

from fxforge import CheckpointError, ForgeGraph

EXAMPLES = int(os.environ.get("FXFORGE_FUZZ_EXAMPLES", "100"))
BUDGET_S = 20.0  # CPU seconds per input: a load takes well under one; the quadratic escape scan took hours
CANARY = Path(tempfile.gettempdir()) / "fxforge_fuzz_canary"
PAYLOADS = [
    f"x':x}}), self._in_spec)\n__import__('os').system('touch {CANARY}')\ndef _f(self, x):\n    x, = ([], {{'x",
    f"__import__('os').system('touch {CANARY}')", "x\n", "self", "__class__", "../../etc/passwd", "os.system",
    "builtins.eval", "collections.defaultdict", "transformers.evil.X", "torch.ops.aten._print.default",
    "torch.ops.aten.set_grad_enabled.default", "torch.ops.aten.manual_seed.default", "torch.Tensor.requires_grad_",
    "fc.weight", "fc", "*", "x", "output", "placeholder", "get_attr", "call_method", "call_function",
    "torch.nn.Linear", "device", "cpu", "meta",
]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                    st.sampled_from(PAYLOADS), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                      st.dictionaries(st.sampled_from(PAYLOADS) | st.text(max_size=6),
                                                                      kids, max_size=3)), max_leaves=8)
RAN = {"mutations": 0, "loaded": 0, "refused": 0}


def _mutate(doc: Any, data: st.DataObject) -> Any:
    """Replace, delete or insert at one random place in the document."""
    return mutate_json(doc, data, VALUES, st.sampled_from(PAYLOADS), st.sampled_from(PAYLOADS))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_checkpoint_loads_or_fails_cleanly(export_ckpt: Path, data: st.DataObject,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    name = data.draw(st.sampled_from(["graph.json", "graph.json", "graph.json", "metadata.json", "manifest.json"]))
    rounds = data.draw(st.integers(1, 3))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(shutil.copytree(export_ckpt, Path(tmp) / "ckpt"))
        doc = json.loads((ckpt / name).read_text())
        for _ in range(rounds):
            doc = _mutate(doc, data)
        text = json.dumps(doc).encode()
        if data.draw(st.integers(0, 4)) == 0:  # cut short into a long run of escaped quotes (quadratic before)
            cut = data.draw(st.integers(0, len(text)))
            text = text[:cut] + b'"' + b'\\"' * data.draw(st.integers(1, 200_000))
        (ckpt / name).write_bytes(text)
        if name != "manifest.json":
            remanifest(ckpt)
        opened: list[str] = []
        real_open = os.open
        with monkeypatch.context() as m:
            m.setattr(os, "open", lambda p, *a, **k: opened.append(os.fspath(p)) or real_open(p, *a, **k))
            RAN["mutations"] += 1
            start = time.process_time()
            try:
                ForgeGraph.from_checkpoint(ckpt)
                RAN["loaded"] += 1
            except CheckpointError:
                RAN["refused"] += 1
            spent = time.process_time() - start
        assert spent < BUDGET_S, f"one mutated checkpoint took {spent:.1f} s of CPU (budget {BUDGET_S} s)"
        assert not CANARY.exists(), "a mutated checkpoint ran code"
        outside = [p for p in opened if not os.path.abspath(p).startswith(str(ckpt))]
        assert not outside, f"opened files outside the checkpoint: {outside}"


def teardown_module() -> None:
    print(f"\nfuzz: {RAN['mutations']} mutated checkpoints, {RAN['loaded']} loaded, {RAN['refused']} refused")
