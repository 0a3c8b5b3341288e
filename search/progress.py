"""What a search's progress bar needs from the rest of the terminal: Optuna's log lines and the Trainer's bars.

While the search bar is shown, each record Optuna logs (``Trial 3 finished with value ...``) is written
above the bar with ``tqdm.write`` instead of through Optuna's stream handler in the middle of the bar's
line, and a trial that trains (NAS, fine-tunes) runs the HF Trainer without a bar of its own nested in
the search's. Only public interfaces are used: the standard ``logging`` handlers of the ``optuna``
logger (a filter on each) and a flag the task reads.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Any

__all__ = ["OptunaLogsAboveBar", "search_bar_shown"]

_STATE = threading.local()


def search_bar_shown() -> bool:
    """True while this thread shows a search progress bar (a trial's trainer should then show none)."""
    return bool(getattr(_STATE, "depth", 0))


class _AboveBar(logging.Filter):
    """A filter on one of Optuna's handlers: writes the record formatted as that handler would, above the
    bar, and stops the handler from writing it into the bar's line."""

    def __init__(self, handler: logging.Handler, bar: Any) -> None:
        super().__init__()
        self.handler, self.bar = handler, bar

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.handler.level:
            return False
        try:
            self.bar.write(self.handler.format(record), file=getattr(self.handler, "stream", None))
        except Exception:  # noqa: BLE001 - a closed stream, a bad record: report it as logging would, never raise
            self.handler.handleError(record)
        return False


class OptunaLogsAboveBar:
    """Context manager: while ``bar`` (a tqdm bar, or None for no bar) is shown, route Optuna's log records
    above it and mark the thread as showing a search bar (see :func:`search_bar_shown`)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.filters: list[_AboveBar] = []

    def __enter__(self) -> OptunaLogsAboveBar:
        if self.bar is None:
            return self
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        for handler in logging.getLogger("optuna").handlers:
            flt = _AboveBar(handler, type(self.bar))
            handler.addFilter(flt)
            self.filters.append(flt)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar is None:
            return
        _STATE.depth -= 1
        for flt in self.filters:
            flt.handler.removeFilter(flt)
        self.filters.clear()
