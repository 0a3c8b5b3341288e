"""Quiet helpers: third-party chatter silenced inside fxforge only, settings restored; one hub probe per process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from fxforge.hub import hub_reachable, reset_probe
from fxforge.quiet import QUIET_LOGGERS, quiet


def test_quiet_restores_logger_levels() -> None:
    logging.getLogger("transformers").setLevel(logging.INFO)
    before = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with quiet():
        assert all(logging.getLogger(n).level == logging.ERROR for n in QUIET_LOGGERS)
    assert {name: logging.getLogger(name).level for name in QUIET_LOGGERS} == before
    logging.getLogger("transformers").setLevel(logging.NOTSET)


def test_quiet_ignores_only_its_known_warnings_and_only_inside() -> None:
    """quiet()'s own filters decide: a known warning (huggingface_hub's) is dropped inside the block, an unknown
    warning is not, and after the block the known one shows again (the filters were scoped, not installed
    globally). torch's LeafSpec warning is not on the list: copies and captures no longer build pytree specs
    (tests/graph/test_copy.py)."""
    known = "`resume_download` is deprecated and will be removed in version 1.0.0."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet():
            warnings.warn(known, FutureWarning, stacklevel=1)
            warnings.warn("something new and worth seeing", FutureWarning, stacklevel=1)
        warnings.warn(known, FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something new and worth seeing", known]


def test_loading_minilm_prints_nothing() -> None:
    """fxforge's loader keeps transformers' load report, torchao's library notices and pytree deprecations out:
    the process prints only what the caller prints (no list of third-party texts to miss a new one)."""
    code = "from fxforge.models import bert; bert.minilm_for_sequence_classification(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and proc.stdout == "loaded\n", proc.stderr
    assert proc.stderr == ""


def test_hub_probe_runs_once_and_says_so_once(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    reset_probe()
    try:
        assert hub_reachable() is False and hub_reachable() is False
        assert capsys.readouterr().err.count("not reachable; working offline") == 1
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        reset_probe()
        assert hub_reachable() is False and capsys.readouterr().err == ""
    finally:
        reset_probe()
