"""The ``fxforge`` command line (typer): inspect, run, search, report, verify, draw, generate, deploy.

``main()`` is the console script: any failure is one line on stderr and exit code 1 (usage errors: 2),
with the traceback only under ``--debug`` (accepted anywhere on the command line).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import click
import typer

from .errors import one_line

__all__ = ["app", "main"]

app = typer.Typer(
    name="fxforge",
    help="Capture PyTorch models into a torch.fx IR, run pass pipelines and searches, export, verify and report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show tracebacks of failures.")) -> None:
    """fxforge: graph capture, passes, search, pickle-free checkpoints."""


def _click_classes(name: str) -> tuple[type[BaseException], ...]:
    """``name`` from click's exceptions and from the copy typer >= 0.16 vendors (``typer._click``)."""
    found = [getattr(click.exceptions, name)]
    vendored = getattr(getattr(typer, "_click", None), "exceptions", None)
    if vendored is not None and hasattr(vendored, name):
        found.append(getattr(vendored, name))
    return tuple(found)


_EXIT, _CLICK_ERROR, _ABORT = _click_classes("Exit"), _click_classes("ClickException"), _click_classes("Abort")


@runtime_checkable
class _Exits(Protocol):
    """What click's Exit / ClickException and typer's copies share (found by name, so typed by their shape)."""

    exit_code: int


@runtime_checkable
class _Shows(_Exits, Protocol):
    """A ClickException: it prints its own message."""

    def show(self) -> None: ...


def _exit_code(exc: BaseException) -> int:
    """The exit code an Exit or ClickException carries (1 for anything without one)."""
    return exc.exit_code if isinstance(exc, _Exits) and isinstance(exc.exit_code, int) else 1


def _register() -> None:
    from . import checkpoint_cmds, commands, deploy, distributed, explore_cmd, generate, hardware  # noqa: F401 - importing registers the commands on ``app``


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: sys.argv) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        _register()
        result = app(args=args, prog_name="fxforge", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except _EXIT as exc:
        return _exit_code(exc)
    except _CLICK_ERROR as exc:
        if isinstance(exc, _Shows):
            exc.show()
        return _exit_code(exc)
    except _ABORT:
        print("fxforge: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("fxforge: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's job is to turn any failure into one line
        if debug:
            traceback.print_exc()
        print(f"fxforge: error: {one_line(exc)}", file=sys.stderr)
        return 1
