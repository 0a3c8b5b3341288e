"""Which implementation a fused op runs: the Triton kernel or the torch reference.

CUDA tensors run Triton (when it is installed); CPU tensors run the reference, unless
``TRITON_INTERPRET=1`` is set, in which case the Triton code runs on CPU under Triton's interpreter
(tests only: it is thousands of times slower). :func:`kernel_backend` forces one side in a block.
Triton modules (``*_triton.py``) are imported lazily, on first use, so their ``@triton.jit``
definitions see the interpreter setting that is current then, not at ``import fxforge`` time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
_forced: list[str] = ["auto"]


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs the Triton kernel (see the module docstring for the rule)."""
    mode = _forced[-1]
    if mode == "reference" or not triton_available():
        if mode == "triton":
            raise RuntimeError("kernel_backend('triton') was forced but triton is not installed")
        return False
    if x.device.type == "cuda":
        return True
    if x.device.type == "cpu" and interpreting():
        return True
    if mode == "triton":
        raise RuntimeError(f"kernel_backend('triton') on a {x.device.type} tensor needs CUDA or TRITON_INTERPRET=1")
    return False


@contextlib.contextmanager
def kernel_backend(backend: Backend) -> Iterator[None]:
    """Force every fused op inside the block to run ``backend`` ("triton", "reference" or "auto")."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def triton_module(name: str) -> ModuleType:
    """Import ``fxforge.kernels.<name>`` (a module with ``@triton.jit`` code) on first use."""
    return importlib.import_module(f"{__package__}.{name}")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block sizes must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def row_warps(block_size: int) -> int:
    """The tutorial's ``num_warps`` rule: more warps per row as rows get wider."""
    return 16 if block_size >= 8192 else 8 if block_size >= 2048 else 4
