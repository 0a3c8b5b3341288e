"""CLI command ``pipeline-run``: run a checkpoint's graph as N pipeline stages on N processes (fxforge.distributed).

Started as is, the command launches the N local ranks itself; started by ``torchrun`` (``--nnodes``,
``--rdzv-endpoint`` on each host), each process is one rank of that job. Rank 0 writes the outputs.
"""

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError

__all__ = ["pipeline_run_cmd"]


@app.command("pipeline-run")
def pipeline_run_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="An fxforge checkpoint directory (ForgeGraph.export).")],
    stages: Annotated[int, typer.Option("--stages", "-n", help="Pipeline stages, one process each.")],
    inputs: Annotated[Path, typer.Option("--input", help="A safetensors file of the graph's inputs by name.")],
    output: Annotated[Path, typer.Option("--output", help="Where rank 0 writes the outputs (safetensors).")],
    schedule: Annotated[str, typer.Option(help="gpipe or 1f1b.")] = "gpipe",
    microbatches: Annotated[int | None, typer.Option(
        help="Microbatches per step (default: one per stage); they must divide the batch.")] = None,
    balance: Annotated[str, typer.Option(help="What the cut balances: time, memory or params.")] = "time",
    timeout: Annotated[float, typer.Option(help="Seconds any collective may wait before the job fails.")] = 300.0,
    threads: Annotated[int | None, typer.Option(help="Threads per rank (default: the cores shared out).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Hosts of the job (each runs this command).")] = 1,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", help="HOST:PORT where the hosts meet (default: a free port on 127.0.0.1).")] = None,
    split_embedding: Annotated[bool, typer.Option(
        "--split-embedding", help="Split the first stage's largest embedding table by rows over all the ranks "
        "(each holds 1/N of it; same outputs).")] = False,
) -> None:
    """Run CHECKPOINT on --input as --stages pipeline stages (torch.distributed.pipelining, gloo on CPU, NCCL with
    CUDA) and write the outputs to --output; prints the cuts and each rank's share of the parameters."""
    from ..distributed.pipeline import PipelineError, pipeline_run

    try:
        result = pipeline_run(checkpoint, stages, inputs, output, schedule=schedule, microbatches=microbatches,
                              balance=balance, timeout=timeout, threads=threads, nnodes=nnodes,
                              rdzv_endpoint=rdzv_endpoint, split_embedding=split_embedding)
    except PipelineError as exc:
        raise CliError(str(exc)) from None
    for report in result.ranks:
        typer.echo(f"rank {report.rank}: stage {report.stage}, {report.held_param_bytes / 2**20:.2f} MiB of "
                   f"parameters ({100 * report.held_share:.1f}% of the graph), {report.threads} thread(s)")
    if result.ranks and result.ranks[0].rank == 0:
        typer.echo(f"cuts after {', '.join(result.cuts) or '(none)'}; outputs {', '.join(result.outputs)} -> {output}")
