"""CLI commands on an exported checkpoint: ``verify``, ``draw`` and ``report``."""

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError

Ckpt = Annotated[Path, typer.Argument(help="An fxforge checkpoint directory.")]


def _checkpoint(path: Path) -> Path:
    if not path.exists():
        raise CliError(f"{path}: no such checkpoint directory")
    return path


@app.command()
def verify(
    ckpt: Ckpt,
    expected_sha256: Annotated[str | None, typer.Option(
        "--expected-sha256", help="The manifest SHA-256 the checkpoint's publisher printed; refuse any other.")]
    = None,
) -> None:
    """Check manifest hashes, the target allowlist, reload, a run on the example inputs, and recorded outputs;
    prints the manifest's SHA-256 (the digest to publish and pin) and the weight bytes stored (packed and
    unpacked) beside the graph's accounted weight_bits / 8."""
    from ..graph.verify import verify_checkpoint
    from ..search.objectives import weight_bits

    report, _ = verify_checkpoint(_checkpoint(ckpt), expected_sha256=expected_sha256, weight_bits=weight_bits)
    typer.echo(report.text())
    if not report.ok:
        failed = next(c for c in report.checks if c.status == "failed")
        raise CliError(f"{ckpt}: verification failed at {failed.name}: {failed.detail}")


@app.command()
def draw(ckpt: Ckpt, out: Annotated[Path, typer.Option("-o", "--out", help="SVG file to write.")]) -> None:
    """Write an SVG drawing of the checkpoint's graph."""
    from ..graph.forge_graph import ForgeGraph

    path = ForgeGraph.from_checkpoint(_checkpoint(ckpt)).draw(out)
    typer.echo(f"wrote {path}")


@app.command()
def report(
    ckpt: Ckpt,
    out: Annotated[Path, typer.Option("-o", "--out", help="HTML file to write.")],
    after: Annotated[Path | None, typer.Argument(
        help="A second checkpoint (e.g. a pipeline's output): write the before / after page of CKPT -> AFTER.")]
    = None,
    accuracy: Annotated[list[float] | None, typer.Option(
        "--accuracy", help="With AFTER: the measured accuracy of CKPT, then of AFTER (give it twice).")] = None,
    search: Annotated[Path | None, typer.Option(
        help="Search results JSON (fxforge search --results) to plot; its interactive page goes to OUT-search.html.")]
    = None,
    deploy: Annotated[list[Path] | None, typer.Option(
        "--deploy", help="A deploy directory (fxforge deploy) whose artifact and check to show; repeatable.")]
    = None,
) -> None:
    """Write one self-contained HTML report: drawing, node table, pass history, quantization, search plots,
    deploy artifacts and their checks."""
    from ..deploy import read_manifest
    from ..graph.forge_graph import ForgeGraph
    from ..report import write_report
    from ..report.search_json import load_search_results
    from .deploy_view import report_row
    from .inspect_cmd import ensure_metadata

    if after is not None:
        return _compare(_checkpoint(ckpt), _checkpoint(after), out, accuracy or [])
    if accuracy:
        raise CliError("--accuracy is for a before / after report: give a second checkpoint (fxforge report A B)")
    results = None if search is None else load_search_results(search)  # checked field by field, errors name both
    artifacts = [report_row(read_manifest(d), d) for d in deploy or []]  # hostile files, checked before any work
    mg = ensure_metadata(ForgeGraph.from_checkpoint(_checkpoint(ckpt)))
    path = write_report(mg, out, title=f"fxforge report: {ckpt.name}", search_results=results, deploy=artifacts)
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
    if results is not None:  # the interactive search page beside it (plotly inlined: ~5 MB, so not in the report)
        from ..report.search_pages import write_search_page

        page = write_search_page(results, out.with_name(f"{out.stem}-search.html"), title=f"fxforge search: {search}")
        typer.echo(f"wrote {page} ({page.stat().st_size / 1e3:.0f} kB)")


def _compare(before: Path, after: Path, out: Path, accuracy: list[float]) -> None:
    """``fxforge report A B``: the before / after page (report/compare.py)."""
    from ..graph.forge_graph import ForgeGraph
    from ..report.compare import compare_graphs, write_comparison
    from ..search.objectives import weight_bits

    if len(accuracy) not in (0, 2):
        raise CliError(f"--accuracy takes two values (before, then after), got {len(accuracy)}")
    acc = (accuracy[0], accuracy[1]) if accuracy else (None, None)
    a, b = ForgeGraph.from_checkpoint(before), ForgeGraph.from_checkpoint(after)
    cmp = compare_graphs(a, b, names=(before.name, after.name), checkpoints=(before, after), accuracy=acc,
                         weight_bits=weight_bits)
    path = write_comparison(cmp, out, title=f"fxforge report: {before.name} -> {after.name}")
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB): {len(cmp.layers)} changed layer(s)")
