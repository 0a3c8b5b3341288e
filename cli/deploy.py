"""CLI command ``deploy``: export MODEL to ONNX, an AOTInductor package or ExecuTorch, checked outside fxforge.

MODEL is resolved as for ``inspect`` (checkpoint, HF directory, zoo name, hub name); the export and the
subprocess check are ``fxforge.deploy.export_onnx`` / ``export_aoti`` / ``export_executorch``. The command prints
the artifact's path and size, its inputs and outputs with their dynamic axes, its quantization and the check, one
row per input shape.
"""

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError

__all__ = ["default_out", "deploy"]


def default_out(model: str, fmt: str) -> Path:
    """``<model name>-<format>`` in the current directory (``tiny-bert-onnx``, ``minilm.v1-aoti`` for a checkpoint
    at ``ckpt/minilm.v1``, ``name-onnx`` for the hub name ``org/name``)."""
    name = Path(model.rstrip("/")).name or Path(model).resolve().name or "model"
    return Path(f"{name}-{fmt}")


@app.command()
def deploy(
    model: Annotated[str, typer.Argument(help="Model to export (as for inspect): a zoo name, a HuggingFace model "
                                              "directory, a hub name or an fxforge checkpoint directory.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="onnx (ONNX Runtime; QDQ when quantized), aoti "
                                                            "(AOTInductor .pt2 package) or pte (ExecuTorch with "
                                                            "XNNPACK; float graphs, batch 1 to 8).")],
    out: Annotated[Path | None, typer.Option(
        "-o", "--out", help="Directory to write (default: <model name>-<format> here). An existing directory is "
                            "replaced only when it holds an earlier deploy.")] = None,
    dynamic_batch: Annotated[bool, typer.Option(
        "--dynamic-batch/--no-dynamic-batch", help="Any batch size, where the graph's shape guard allows it.")]
    = True,
    dynamic_seq: Annotated[bool, typer.Option(
        "--dynamic-seq/--no-dynamic-seq", help="Any sequence length within the range the graph's shape guard "
                                               "proves.")] = True,
) -> None:
    """Export MODEL to ONNX, an AOTInductor package or an ExecuTorch program, check it in a subprocess that cannot
    import fxforge, and print the artifact's size and the check (exit 1 when the export or the check fails)."""
    from ..deploy import export_aoti, export_executorch, export_onnx
    from ..passes.analysis.table import terminal_width

    exporters = {"onnx": export_onnx, "aoti": export_aoti, "pte": export_executorch}
    if fmt not in exporters:
        raise typer.BadParameter(f"{fmt!r} is not a deploy format; choose one of {', '.join(exporters)}",
                                 param_hint="'--format'")
    from ..deploy.output_dir import check_output_dir
    from .deploy_view import manifest_lines
    from .resolve import load_graph

    target = out if out is not None else default_out(model, fmt)
    check_output_dir(target)  # a path that cannot be written fails before the model is loaded
    mg, source = load_graph(model)
    manifest = exporters[fmt](mg, target, dynamic_batch=dynamic_batch, dynamic_seq=dynamic_seq, check=True,
                      source=model)
    typer.echo(f"deployed {source} as {fmt} to {target}")
    typer.echo("\n".join(manifest_lines(manifest, target, terminal_width())))
    if not manifest.passed:
        raise CliError(f"{target}: the artifact's check outside fxforge failed (see the table above)")
