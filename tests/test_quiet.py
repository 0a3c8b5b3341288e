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


def test_quiet_restores_logger_levels_and_scopes_warning_filters() -> None:
    logging.getLogger("transformers").setLevel(logging.INFO)
    before = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with quiet():
        assert all(logging.getLogger(n).level == logging.ERROR for n in QUIET_LOGGERS)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        assert not seen
    assert {name: logging.getLogger(name).level for name in QUIET_LOGGERS} == before
    logging.getLogger("transformers").setLevel(logging.NOTSET)


def test_loading_minilm_prints_no_load_report_or_torchao_noise() -> None:
    code = "from fxforge.models import bert; bert.minilm_for_sequence_classification(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded", proc.stderr
    for noise in ("LOAD REPORT", "Failed to load", "register_constant", "Loading weights"):
        assert noise not in proc.stderr + proc.stdout


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
