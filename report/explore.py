"""Model Explorer (PyPI ``ai-edge-model-explorer``, module ``model_explorer``) on a ForgeGraph, with fxforge's
per-node figures (report/overlays.py) as its node-data overlays, through the package's documented Python API.

The graph reaches Model Explorer as an ExportedProgram (``torch.export.export`` of the graph's GraphModule on its
example inputs; ``config().add_model_from_pytorch``), which the package's own adapter converts; checked on
ai-edge-model-explorer 0.1.34 with torch 2.13. Each overlay is written as a node-data JSON file
(``node_data_builder.ModelNodeData``) keyed by the ExportedProgram's node ids: an fxforge node's value goes to
the last ATen node exported from it (found through torch's ``from_node`` provenance), so a group's sum counts
it once. Model Explorer's server checks PyPI for a newer version when it starts (it ignores the failure offline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..graph.forge_graph import ForgeGraph
from .overlays import OVERLAYS

__all__ = ["ExplorerError", "ExplorerFiles", "exported_program", "explorer_node_ids", "start_explorer",
           "write_node_data"]

GRAPH_ID = "graph"  # the id model_explorer's ExportedProgram adapter gives its one graph
LOW, HIGH = "#2e7d32", "#d32f2f"  # gradient ends: good -> bad


class ExplorerError(RuntimeError):
    """Model Explorer cannot show this graph; the message says why and what to do."""


@dataclass(frozen=True)
class ExplorerFiles:
    """The ExportedProgram shown, and the node-data JSON written per overlay (overlay key -> file)."""

    program: torch.export.ExportedProgram
    node_data: dict[str, Path]


def _import_model_explorer() -> Any:
    try:
        import model_explorer  # type: ignore[import-untyped]  # no py.typed in 0.1.34
    except ImportError as exc:
        raise ExplorerError("fxforge explore needs Model Explorer: pip install ai-edge-model-explorer") from exc
    return model_explorer


def exported_program(mg: ForgeGraph) -> torch.export.ExportedProgram:
    """``torch.export`` of the graph's GraphModule on its example inputs (non-strict: the module is fx code)."""
    if mg.example_inputs is None:
        raise ExplorerError("fxforge explore: the graph has no example inputs to export it with; capture it with "
                            "example_inputs (or hf_input_names) and export the checkpoint again")
    inputs = mg.example_inputs
    try:
        with torch.no_grad():
            return torch.export.export(mg.model, tuple(inputs.args), dict(inputs.kwargs), strict=False)
    except Exception as exc:  # noqa: BLE001 - any export failure becomes one message naming the cause
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ExplorerError(f"fxforge explore: torch.export (torch {torch.__version__}) could not export this graph "
                            f"for Model Explorer: {first}") from exc


def _sources(node: fx.Node) -> list[str]:
    """Names of the nodes ``node`` was traced from, innermost first (torch's ``from_node`` provenance)."""
    names, stack = [], list(node.meta.get("from_node") or [])
    while stack:
        src = stack.pop()
        names.append(src.name)
        stack.extend(src.from_node or [])
    return names


def explorer_node_ids(mg: ForgeGraph, program: torch.export.ExportedProgram) -> dict[str, str]:
    """fxforge node name -> the id of the last ExportedProgram node exported from it (Model Explorer's node id)."""
    ours = {n.name for n in mg.nodes}
    out: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        origin = next((name for name in _sources(node) if name in ours), None)
        if origin is not None:
            out[origin] = node.name  # graph order: the last one wins
    return out


def _file_name(key: str) -> str:
    return "fxforge_" + re.sub(r"[^A-Za-z0-9_]", "_", key) + ".json"


def write_node_data(mg: ForgeGraph, program: torch.export.ExportedProgram, out_dir: str | Path) -> dict[str, Path]:
    """One Model Explorer node-data JSON per overlay that has values (overlay key -> file), in ``out_dir``."""
    _import_model_explorer()  # a clear error when the package is missing
    from model_explorer.node_data_builder import (  # type: ignore[import-untyped]
        GradientItem,
        GraphNodeData,
        ModelNodeData,
        NodeDataResult,
    )

    from .overlays import node_values

    ids = explorer_node_ids(mg, program)
    values = {n.name: node_values(n, mg.model) for n in mg.nodes if n.name in ids}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for overlay in OVERLAYS:
        results = {ids[name]: NodeDataResult(value=v[overlay.key]) for name, v in values.items() if overlay.key in v}
        if not results:
            continue
        low, high = (LOW, HIGH) if overlay.higher_is_worse else (HIGH, LOW)
        data = GraphNodeData(results=results, name=overlay.title,
                             gradient=[GradientItem(stop=0, bgColor=low), GradientItem(stop=1, bgColor=high)])
        path = out / _file_name(overlay.key)
        ModelNodeData(graphsData={GRAPH_ID: data}).save_to_file(str(path))
        written[overlay.key] = path
    return written


def prepare(mg: ForgeGraph, name: str, out_dir: str | Path) -> tuple[Any, ExplorerFiles]:
    """The Model Explorer config (the graph and every overlay file added) and what was written."""
    me = _import_model_explorer()
    program = exported_program(mg)
    config = me.config()
    try:
        config.add_model_from_pytorch(name, exported_program=program)
    except Exception as exc:  # noqa: BLE001 - the package's adapter failing on this torch's program
        raise ExplorerError(f"fxforge explore: Model Explorer ({getattr(me, '__version__', '?')}) could not load the "
                            f"ExportedProgram of torch {torch.__version__}: {type(exc).__name__}: {exc}"[:500]) from exc
    files = write_node_data(mg, program, out_dir)
    for path in files.values():
        config.add_node_data_from_path(str(path), model_name=name)
    return config, ExplorerFiles(program, files)


def start_explorer(mg: ForgeGraph, name: str, out_dir: str | Path, host: str = "localhost", port: int = 8080,
                   open_browser: bool = True) -> None:
    """Serve Model Explorer on ``mg`` with the overlays (blocks until interrupted, as Model Explorer does)."""
    me = _import_model_explorer()
    config, _ = prepare(mg, name, out_dir)
    me.visualize_from_config(config=config, host=host, port=port, no_open_in_browser=not open_browser)
