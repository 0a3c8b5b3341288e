"""``fxforge explore CKPT``: Model Explorer on a checkpoint's graph with fxforge's per-node overlays."""

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError


@app.command()
def explore(
    ckpt: Annotated[Path, typer.Argument(help="An fxforge checkpoint directory.")],
    port: Annotated[int, typer.Option(help="Server port (8080: Model Explorer takes the first free one from there).")]
    = 8080,
    host: Annotated[str, typer.Option(help="Server host.")] = "localhost",
    no_open: Annotated[bool, typer.Option("--no-open", help="Do not open a browser tab.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Directory for the node-data JSON files (default: CKPT's name + '-explore' beside it).")] = None,
    no_serve: Annotated[bool, typer.Option(
        "--no-serve", help="Only write the node-data JSON files (to load into a running Model Explorer).")] = False,
) -> None:
    """Open Model Explorer (ai-edge-model-explorer) on the checkpoint's graph, its overlays (precision, sparsity,
    parameters, FLOPs, latency, memory where recorded) as node data; serves until Ctrl+C."""
    from ..graph.forge_graph import ForgeGraph
    from ..report.explore import ExplorerError, prepare, start_explorer
    from .inspect_cmd import ensure_metadata

    if not ckpt.exists():
        raise CliError(f"{ckpt}: no such checkpoint directory")
    mg = ensure_metadata(ForgeGraph.from_checkpoint(ckpt))
    target = out if out is not None else ckpt.parent / f"{ckpt.name}-explore"
    try:
        if no_serve:
            _, files = prepare(mg, ckpt.name, target)
            for key, path in files.node_data.items():
                typer.echo(f"wrote {path} ({key})")
            return
        start_explorer(mg, ckpt.name, target, host=host, port=port, open_browser=not no_open)
    except ExplorerError as exc:
        raise CliError(str(exc)) from None
