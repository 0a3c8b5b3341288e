"""Silence known-harmless third-party chatter inside fxforge's own helpers, never globally.

``with quiet():`` raises the transformers / torchao / torch pytree loggers to ERROR, turns off HF
progress bars and ignores a short list of known deprecation warnings, then restores every setting, so
a user's own ``from_pretrained`` calls outside fxforge print exactly what they printed before.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["QUIET_LOGGERS", "quiet"]

QUIET_LOGGERS = ("transformers", "torchao", "torch.utils._pytree", "huggingface_hub", "datasets", "accelerate",
                 "optuna")
_HARMLESS_WARNINGS = (
    r".*register_constant\(\) on Enum subclasses.*",
    r".*TRANSFORMERS_CACHE.*",
    r".*`resume_download` is deprecated.*",
    r"BruteForceSampler is experimental.*",  # optuna's grid sampler, stable in practice since optuna 3.1
)


@contextmanager
def quiet(progress_bars: bool = False) -> Iterator[None]:
    """Within the block: third-party loggers at ERROR, HF progress bars off (unless asked), known warnings ignored."""
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    from transformers.utils import logging as hf_logging  # a dependency: always installed

    bars = hf_logging.is_progress_bar_enabled()
    if not progress_bars:
        hf_logging.disable_progress_bar()
    ds_bars = None
    try:
        from datasets.utils import logging as ds_logging

        ds_bars = ds_logging.is_progress_bar_enabled()
        if not progress_bars:
            ds_logging.disable_progress_bar()
    except ImportError:  # datasets is optional for the loaders that use quiet()
        ds_logging = None
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            for pattern in _HARMLESS_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
        if ds_logging is not None and ds_bars:
            ds_logging.enable_progress_bar()
