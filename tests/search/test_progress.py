"""Optuna's log records while a search bar is shown: written above the bar through tqdm, never into the bar's
line, never raising (a closed stream is reported as logging reports it); trainers see the bar is shown."""

from __future__ import annotations

import io
import logging

import optuna
from tqdm import tqdm

from fxforge.search.progress import OptunaLogsAboveBar, search_bar_shown


def test_optuna_records_go_above_the_bar_and_a_closed_stream_does_not_raise() -> None:
    logger = logging.getLogger("optuna")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO)
    try:
        bar = tqdm(total=2, file=stream, desc="search s")
        assert not search_bar_shown()
        with OptunaLogsAboveBar(bar):
            assert search_bar_shown()
            logging.getLogger("optuna.study").info("Trial 0 finished")
            bar.update(1)
        bar.close()
        text = stream.getvalue()
        parts = [p for line in text.split("\n") for p in line.split("\r")]
        assert "[INFO] Trial 0 finished" in parts  # a line of its own, not glued to the bar's text
        assert not search_bar_shown() and handler.filters == []
        closed = io.StringIO()
        handler.setStream(closed)
        closed.close()
        with OptunaLogsAboveBar(tqdm(total=1, file=io.StringIO())):
            logging.raiseExceptions, old = False, logging.raiseExceptions
            try:
                logging.getLogger("optuna.study").info("Trial 1 finished")  # reported, not raised
            finally:
                logging.raiseExceptions = old
    finally:
        optuna.logging.set_verbosity(verbosity)
        logger.removeHandler(handler)
