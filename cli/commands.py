"""CLI commands that start from a model or a config: ``inspect``, ``run`` (pipelines) and ``search``.

``run`` and ``search`` plug into fxforge.pipelines / fxforge.search: when this build lacks them the
command exits 1 saying so, instead of pretending to work.
"""

import importlib
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from .app import app
from .errors import CliError

MaybeInt = Annotated[int | None, typer.Option(help="Override the config's n_trials (the study's total).")]
OutputRoot = Annotated[Path | None, typer.Option(
    "--output-root", help="Directory the paths the file names for writing resolve under (default: the current "
                          "directory).")]
AllowOutside = Annotated[bool, typer.Option(
    "--allow-outside-root", help="Let the file write outside the output root (absolute paths, '..').")]


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict through fxforge's one hardened reader (size cap, strict UTF-8, regular file);
    CliError naming the file otherwise."""
    from ..graph.toml_file import load_toml_file

    return load_toml_file(path, what, CliError)


def _feature(module: str, attr: str, what: str) -> Any:
    """``module.attr`` when this build has it; CliError saying the feature is not available otherwise."""
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        found = None
    if found is None:
        raise CliError(f"{what} are not available in this build")
    return found


@app.command()
def inspect(
    model: Annotated[str | None, typer.Argument(help="Zoo name (minilm, tiny-bert, gpt, gpt-afno, agru), a "
                                                     "HuggingFace model directory, a hub name, an fxforge checkpoint "
                                                     "directory or a deploy directory.")] = None,
    all_nodes: Annotated[bool, typer.Option("--all", help="Show every node, not the first 40.")] = False,
    mase_names: Annotated[bool, typer.Option("--mase-names", help="Print every MASE pass name with its fxforge "
                                                                  "name and status (no MODEL needed).")] = False,
) -> None:
    """Capture MODEL (or reload a checkpoint) and print its nodes, ops, parameters and metadata; for a deploy
    directory (fxforge deploy), print its artifact and check results."""
    from ..deploy import is_deploy_dir
    from .inspect_cmd import deploy_summary, ensure_metadata, mase_names_table, summary
    from .resolve import load_graph

    if mase_names:
        typer.echo(mase_names_table())
        return
    if model is None:
        raise typer.BadParameter("give MODEL (or --mase-names)", param_hint="MODEL")
    if is_deploy_dir(model):
        typer.echo(deploy_summary(Path(model)))
        return
    mg, source = load_graph(model)
    typer.echo(summary(ensure_metadata(mg), source, None if all_nodes else 40))


@app.command()
def run(
    pipeline: Annotated[Path, typer.Argument(help="Pipeline TOML file.")],
    model: Annotated[str, typer.Argument(help="Model to capture (as for inspect).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Checkpoint directory to export.")],
    output_root: OutputRoot = None,
    allow_outside_root: AllowOutside = False,
) -> None:
    """Run the pipeline PIPELINE.toml on MODEL and export the result as a checkpoint."""
    _read_toml(pipeline, "pipeline file")
    pipeline_cls = _feature("fxforge.pipelines", "Pipeline", "pipelines")
    from .resolve import load_graph

    pipe = pipeline_cls.from_toml(pipeline, output_root=output_root, allow_outside_root=allow_outside_root)
    mg, source = load_graph(model)
    typer.echo(f"running {pipeline} on {source}")
    graph, report = pipe(mg)
    path = graph.export(out)
    typer.echo(str(report))
    typer.echo(f"exported {path}")


@app.command()
def search(
    config: Annotated[str, typer.Argument(metavar="CONFIG.toml|worker",
                                          help="A search config TOML, or `worker` to join a shared study.")],
    storage: Annotated[str | None, typer.Option(help="Study storage, e.g. postgresql://user@host/db.")] = None,
    study: Annotated[str | None, typer.Option(help="Study name (required for a worker).")] = None,
    n_trials: MaybeInt = None,
    resume: Annotated[bool | None, typer.Option(
        "--resume/--no-resume", help="Continue the study this config created in an earlier run (the default, "
                                     "unless the config sets resume = false); --no-resume refuses an existing "
                                     "study.")] = None,
    results: Annotated[Path | None, typer.Option(help="Write the results JSON here (for `fxforge report "
                                                      "--search`).")] = None,
    mlflow: Annotated[str | None, typer.Option(
        help="Also log one MLflow run per trial: a directory (an SQLite store in it), sqlite:///FILE, file:///DIR "
             "or a tracking server http(s)://HOST:PORT (the config's `mlflow = true`: run_dir/mlflow).")] = None,
    output_root: OutputRoot = None,
    allow_outside_root: AllowOutside = False,
    ddp: Annotated[int | None, typer.Option(
        help="Train each trial data-parallel on N local processes (DDP; gloo on CPU): rank 0 alone talks to the "
             "study. Under torchrun, join its job instead.")] = None,
    ddp_timeout: Annotated[float, typer.Option(
        help="Seconds a distributed trial waits for a silent rank before failing (with --ddp).")] = 1800.0,
) -> None:
    """Run the search CONFIG.toml describes, or join a study as a worker: `search worker --storage`.

    Resumable: rerunning the same CONFIG.toml continues its study (as Optuna's load_if_exists does).

    n_trials is the study's total: `--n-trials 20` after a 10-trial run adds 10 trials.

    A study of that name made from a different config is refused: use --study NAME for a new one.
    """
    overrides: dict[str, Any] = {k: v for k, v in (("storage", storage), ("n_trials", n_trials),
                                                   ("resume", resume), ("mlflow", mlflow)) if v is not None}
    if results is not None:  # an unwritable results file is refused now, not after the whole search ran
        _feature("fxforge.search.paths", "check_writable_file", "searches")(results, "--results")
    options = None if ddp is None else _feature("fxforge.distributed.ddp", "DDPOptions", "distributed trials")(
        nproc=ddp, timeout=ddp_timeout)
    if config == "worker":
        if storage is None or study is None:
            raise CliError("a worker needs --storage postgresql://… (or sqlite:///…) and --study NAME")
        worker = _feature("fxforge.search", "worker", "searches")
        overrides.pop("storage")
        overrides.pop("resume", None)
        if options is not None:
            result = _feature("fxforge.search.ddp_trial", "ddp_worker", "distributed trials")(study, storage, options,
                                                                                              **overrides)
        else:
            result = worker(study, storage, **overrides)
    else:
        doc = _read_toml(Path(config), "search config")
        from_config = _feature("fxforge.search", "search_from_config", "searches")
        if study is not None:
            overrides["study_name"] = study
        if options is not None:  # builds the search here first (a bad config refused), then runs it on N ranks
            from_config = partial(_feature("fxforge.search.ddp_trial", "ddp_config", "distributed trials"),
                                  options=options)
        try:
            built = from_config(doc, output_root=output_root, allow_outside_root=allow_outside_root, **overrides)
        except ValueError as exc:  # SearchError: a section or key of this file; name the file too
            raise CliError(f"{config}: {exc}") from None
        result = built.run() if options is None else built
    if result is None:  # a rank other than 0 of a torchrun job: rank 0 reports
        return
    typer.echo(result.table())
    if results is not None:
        result.to_json(results)
        typer.echo(f"results written to {results}")
