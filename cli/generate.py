"""CLI command ``generate``: greedy tokens from a checkpoint captured with a static KV cache (graph/static_cache)."""

from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .errors import CliError


def parse_ids(text: str, what: str) -> list[int]:
    """Comma-separated non-negative token ids (``1,2,3``); CliError naming the bad item."""
    ids = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdecimal() or len(item) > 12:
            raise CliError(f"{what}: {item!r} is not a token id (comma-separated non-negative integers, e.g. 1,2,3)")
        ids.append(int(item))
    return ids


@app.command()
def generate(
    ckpt: Annotated[Path, typer.Argument(help="An fxforge checkpoint captured with capture_static_cache.")],
    prompt_ids: Annotated[str, typer.Option("--prompt-ids", help="Prompt token ids, comma-separated: 1,2,3.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=0, help="Tokens to generate at most.")],
    eos_token_ids: Annotated[str | None, typer.Option(
        "--eos-token-ids", help="Stop at these ids (comma-separated; default: the model's own, recorded at "
                                "capture).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Never stop early: generate max-new-tokens.")]
    = False,
) -> None:
    """Greedy generation (as HF generate with do_sample=False): prints the prompt and the new tokens as
    comma-separated ids on one line."""
    from ..graph.forge_graph import ForgeGraph
    from ..pipelines import generate as run_generation

    if not (ckpt / "manifest.json").is_file():
        raise CliError(f"{ckpt}: no fxforge checkpoint (manifest.json) there")
    ids = parse_ids(prompt_ids, "--prompt-ids")
    eos = [] if ignore_eos else None if eos_token_ids is None else parse_ids(eos_token_ids, "--eos-token-ids")
    out = run_generation(ForgeGraph.from_checkpoint(ckpt), ids, max_new_tokens, eos_token_ids=eos)
    for row in out.tolist():
        typer.echo(",".join(str(t) for t in row))
