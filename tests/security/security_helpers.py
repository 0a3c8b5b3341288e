"""An attacker's toolkit: rewrite any checkpoint file and recompute the manifest so hashes match."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fxforge import ExampleInputs, ForgeGraph


class Tiny(nn.Module):
    """Linear(4, 8) → GELU → Linear(8, 3), called with a keyword argument (a dict in_spec on export)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = nn.GELU()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x))) * 2.0


def tiny_graph(frontend: str) -> ForgeGraph:
    torch.manual_seed(0)
    return ForgeGraph(Tiny().eval(), example_inputs=ExampleInputs((), {"x": torch.randn(2, 4)}), frontend=frontend)


def fresh_copy(pristine: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(pristine, tmp_path / name, symlinks=True))


def remanifest(path: Path, manifest: dict[str, Any] | None = None) -> None:
    """Recompute every listed file's SHA-256 and size, as an attacker controlling the directory would."""
    manifest = manifest or json.loads((path / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def rewrite(path: Path, name: str, data: bytes) -> None:
    (path / name).write_bytes(data)
    remanifest(path)


def edit_json(path: Path, name: str, edit: Callable[[Any], Any]) -> None:
    doc = json.loads((path / name).read_text())
    out = edit(doc)
    rewrite(path, name, json.dumps(doc if out is None else out).encode())


@pytest.fixture(scope="session")
def export_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny export-captured graph (keyword input: a dict in its input structure), exported once per session.

    A fixture here, imported by the test modules that use it: a second ``conftest.py`` under tests/ would
    shadow tests/conftest.py for modules doing ``from conftest import ...``.
    """
    return tiny_graph("export").export(tmp_path_factory.mktemp("pristine") / "ckpt")


def json_paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (the root is ``()``), for fuzzers to pick one."""
    out = [path]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.extend(json_paths(value, (*path, key)))
    return out


def mutate_json(doc: Any, data: Any, values: Any, keys: Any, payloads: Any = None) -> Any:
    """Replace, delete or insert one value anywhere in ``doc`` (type confusion: any value anywhere): values
    from the ``values`` strategy, new dict keys from ``keys``; with ``payloads``, also replace by one of them."""
    from hypothesis import strategies as st

    path = data.draw(st.sampled_from(json_paths(doc)))
    if not path:
        return data.draw(values)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    actions = ["replace", "delete", "insert"] + (["payload"] if payloads is not None else [])
    action, key = data.draw(st.sampled_from(actions)), path[-1]
    if action == "delete":
        del parent[key]
    elif action == "insert" and isinstance(parent, list):
        parent.insert(key, data.draw(values))
    elif action == "insert":
        parent[data.draw(keys)] = data.draw(values)
    else:
        parent[key] = data.draw(payloads if action == "payload" else values)
    return doc


def export_zoo_gpt(tmp_path_factory: pytest.TempPathFactory, frontend: str) -> Path:
    """The zoo GPT (rotary buffers in a container module) captured with ``frontend`` and exported once."""
    from fxforge.models.zoo import build

    zm = build("gpt")
    return ForgeGraph(zm.model, frontend=frontend, **zm.capture).export(tmp_path_factory.mktemp("zoo") / "gpt")
