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


SensData = Annotated[int | None, typer.Option(
    "--sensitivity-data", help="Measure the 'sensitivity' overlay: sensitivity_analysis_pass on N calibration "
    "batches made from the checkpoint's example inputs.")]
SensFile = Annotated[Path | None, typer.Option(
    "--sensitivity", help="Read the 'sensitivity' overlay from a sensitivity_analysis_pass result JSON "
    "(info.to_json()).")]
SensMethod = Annotated[str, typer.Option(
    "--sensitivity-method", help="With --sensitivity-data: fisher, hessian_trace, sqnr (no labels needed) or loss.")]
SensBits = Annotated[int, typer.Option(
    "--sensitivity-bits", help="With --sensitivity-data: the weight width measured.")]


@app.command()
def draw(
    ckpt: Ckpt,
    out: Annotated[Path, typer.Option("-o", "--out", help="File to write: .svg, .png or .pdf (rendered by Graphviz's "
                                      "dot), or .dot / .gv (the DOT text).")],
    depth: Annotated[str | None, typer.Option(
        help="Module levels drawn open as clusters: 0, 1, 2..., or 'all' (every node); default: the HTML "
        "report's top level.")] = None,
    overlay: Annotated[str | None, typer.Option(
        help="Colour boxes by one of the report's overlays (bits, sparsity, params, flops, latency_ms, memory, "
        "sqnr_db, sensitivity), with a legend.")] = None,
    flat: Annotated[bool, typer.Option(
        "--flat", help="The dependency-free SVG of every node, ungrouped (no Graphviz needed).")] = False,
    sensitivity_data: SensData = None, sensitivity: SensFile = None, sensitivity_method: SensMethod = "sqnr",
    sensitivity_bits: SensBits = 4,
) -> None:
    """Draw the checkpoint's graph grouped by module path, as the HTML report does (Graphviz clusters)."""
    from ..graph.forge_graph import ForgeGraph
    from ..report.dot import find_overlay, hierarchy_dot, parse_depth
    from ..report.dot_render import GraphvizMissingError, write_dot
    from ..report.hierarchy import build_hierarchy
    from .inspect_cmd import ensure_metadata
    from .sensitivity_opts import sensitivity_for

    if flat and (depth is not None or overlay is not None or sensitivity_data is not None or sensitivity is not None):
        raise CliError("--flat draws every node ungrouped and uncoloured: drop --depth, --overlay and --sensitivity*")
    levels = parse_depth(depth)
    if overlay is not None:
        find_overlay(overlay)  # a misspelt name fails before the checkpoint loads
    mg = ForgeGraph.from_checkpoint(_checkpoint(ckpt))
    if flat:
        typer.echo(f"wrote {mg.draw(out)}")
        return
    mg = ensure_metadata(mg)
    sens = sensitivity_for(mg, sensitivity_data, sensitivity, sensitivity_method, sensitivity_bits)
    text = hierarchy_dot(build_hierarchy(mg, sensitivity=sens), depth=levels, overlay=overlay, title=ckpt.name)
    try:
        path = write_dot(text, out)
    except GraphvizMissingError as exc:
        raise CliError(str(exc)) from None
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
    sensitivity_data: SensData = None, sensitivity: SensFile = None, sensitivity_method: SensMethod = "sqnr",
    sensitivity_bits: SensBits = 4,
) -> None:
    """Write one self-contained HTML report: drawing, node table, pass history, quantization, search plots,
    deploy artifacts and their checks; the "sensitivity" overlay with --sensitivity-data or --sensitivity."""
    from ..deploy import read_manifest
    from ..graph.forge_graph import ForgeGraph
    from ..report import write_report
    from ..report.search_json import load_search_results
    from .deploy_view import report_row
    from .inspect_cmd import ensure_metadata
    from .sensitivity_opts import sensitivity_for

    if after is not None and (sensitivity_data is not None or sensitivity is not None):
        raise CliError("--sensitivity-data / --sensitivity colour one graph's report: give one checkpoint")
    if after is not None:
        return _compare(_checkpoint(ckpt), _checkpoint(after), out, accuracy or [])
    if accuracy:
        raise CliError("--accuracy is for a before / after report: give a second checkpoint (fxforge report A B)")
    results = None if search is None else load_search_results(search)  # checked field by field, errors name both
    artifacts = [report_row(read_manifest(d), d) for d in deploy or []]  # hostile files, checked before any work
    mg = ensure_metadata(ForgeGraph.from_checkpoint(_checkpoint(ckpt)))
    sens = sensitivity_for(mg, sensitivity_data, sensitivity, sensitivity_method, sensitivity_bits)
    path = write_report(mg, out, title=f"fxforge report: {ckpt.name}", search_results=results, deploy=artifacts,
                        sensitivity=sens)
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
