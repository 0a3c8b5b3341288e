"""Int8 weight-only linear for CPU decode: ``x @ (w_int8 * scale[:, None]).T + bias``, exact in fp32.

:func:`int8_weight_only_linear` is the entry the weight-only lowering calls; it runs the custom op
``torch.ops.fxforge.int8_weight_only_linear`` (so lowered graphs ``torch.export`` and reload). On a
CPU with AVX2+FMA, fp32 activations and at most ``NATIVE_MAX_ROWS`` rows (decode), the op runs the
C++ kernel in ``woq_int8.cpp``: ATen's ``_weight_int8pack_mm`` is slower than fp32 ``F.linear`` on
AMD EPYC, which defeats the point of reading a quarter of the bytes (and 30-80x slower from 16 rows
on: 50 ms for 16 x 768 -> 2048 where F.linear takes 1.1 ms). More fp32 rows than that ("dequant")
run ``F.linear`` on ``w_int8 * scale`` (one more rounding per weight, within the same bound).
Everything else runs the reference, ``_weight_int8pack_mm`` (+ bias).

The kernel is plain C (no torch headers: it builds in seconds, where a ``cpp_extension`` including
``torch/extension.h`` took ~85 s here) and is called through ctypes. It is built lazily on first use
into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under a name hashed from its
source and flags, so later processes load the cached ``.so``; a failed build warns once and the op
keeps running the reference.

Exactness: both paths compute the exact product up to fp32 rounding; each output obeys
``|y - exact| <= error_bound(...)`` ~= ``(K + 2) * 2**-24 * (scale[n] * sum_k |x[k]| |w[n, k]| + |bias[n]|)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

SOURCE = Path(__file__).with_suffix(".cpp")
CFLAGS: tuple[str, ...] = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
NATIVE_MAX_ROWS = 512  # beyond, x leaves L2 and MKL's blocked GEMM on dequantized weights wins (measured)
MIN_WORK_PER_THREAD = 1 << 17  # multiply-adds below which a second thread costs more than it saves
Backend = Literal["auto", "native", "reference"]
_forced: list[Backend] = ["auto"]


# -- building and loading the C++ kernel ------------------------------------------------------------
def build_root() -> Path:
    """Where built kernels are cached: ``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "torch_extensions"


def library_path(source: Path = SOURCE, root: Path | None = None) -> Path:
    """The cached ``.so`` for ``source``: its name carries a hash of the source text and the flags."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return (root or build_root()) / "fxforge_woq_int8" / f"woq_int8_{digest}.so"


def cpu_supported() -> bool:
    """True on an x86 CPU whose vector capability (as torch detects it) includes AVX2 and FMA."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build(source: Path = SOURCE, root: Path | None = None, compiler: str | None = None) -> Path:
    """Compile ``source`` to its cached ``.so`` unless it exists; return the path (raises on failure).

    The compiler writes to a temporary name that is renamed into place, so concurrent builds by two
    processes cannot leave a half-written library behind.
    """
    out = library_path(source, root)
    if out.exists():
        return out
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(path: Path) -> ctypes.CDLL:
    """Open a built kernel library and declare its C signatures."""
    lib = ctypes.CDLL(str(path))  # after ``import torch``: its libgomp is the one the kernel binds to
    lib.woq_int8_cpu_ok.restype = ctypes.c_int
    lib.woq_int8_linear_f32.restype = None
    lib.woq_int8_linear_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int]  # x, M, K, w, scale, bias|NULL, y, N, threads
    return lib


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The built kernel library, or None (CPU without AVX2+FMA, or a build failure: warned once)."""
    if not cpu_supported():
        return None
    try:
        lib = load(build())
    except Exception as exc:  # any build/load failure: the reference path stays correct
        warnings.warn(f"fxforge.int8_weight_only_linear: the C++ kernel did not build or load, so the "
                      f"op runs ATen's _weight_int8pack_mm (slower on AVX2 CPUs): {exc}", stacklevel=2)
        return None
    return lib if lib.woq_int8_cpu_ok() else None


@contextlib.contextmanager
def woq_int8_backend(backend: Backend) -> Iterator[None]:
    """Force the op inside the block to run ``backend``: "native" (the C++ kernel), "reference" or "auto"."""
    if backend not in ("auto", "native", "reference"):
        raise ValueError(f"woq_int8 backend must be auto, native or reference, got {backend!r}")
    _forced.append(backend)
    try:
        yield
    finally:
        _forced.pop()


def native_eligible(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> bool:
    """Whether the C++ kernel handles these operands (CPU, fp32 activations/scales/bias, int8 weights)."""
    tensors = [x, w_int8, scale] + ([] if bias is None else [bias])
    return (all(t.device.type == "cpu" for t in tensors) and x.dtype == torch.float32
            and w_int8.dtype == torch.int8 and scale.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and x.numel() > 0)


def chosen_backend(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> str:
    """Which path a call with these operands runs: "native", "dequant" or "reference" (module docstring)."""
    mode = _forced[-1]
    if mode == "reference":
        return "reference"
    ok = native_eligible(x, w_int8, scale, bias)
    if mode == "native":
        if not ok or native_library() is None:
            raise RuntimeError("woq_int8_backend('native') was forced but the C++ kernel cannot run these "
                               "operands (needs an AVX2+FMA CPU, a C++ compiler, fp32 x/scale/bias, int8 w)")
        return "native"
    if not ok:
        return "reference"
    if x.numel() // max(x.shape[-1], 1) > NATIVE_MAX_ROWS:
        return "dequant"
    return "native" if native_library() is not None else "reference"


# -- the op -----------------------------------------------------------------------------------------
def _check(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> None:
    n, k = w_int8.shape if w_int8.dim() == 2 else (-1, -1)
    if w_int8.dim() != 2 or x.shape[-1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"fxforge.int8_weight_only_linear: x {tuple(x.shape)} needs w_int8 [N, K={x.shape[-1]}], "
                         f"scale [N] and bias [N] or None; got w_int8 {tuple(w_int8.shape)}, scale "
                         f"{tuple(scale.shape)}, bias {None if bias is None else tuple(bias.shape)}")


def reference(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """The op's meaning in torch: ATen's ``_weight_int8pack_mm`` over the flattened rows, plus bias."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.aten._weight_int8pack_mm(x2, w_int8.contiguous(), scale.to(x.dtype))
    y = y.reshape(*x.shape[:-1], w_int8.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def native(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """The C++ kernel (caller checked :func:`native_eligible` and that the library loaded)."""
    lib = native_library()
    assert lib is not None
    n, k = w_int8.shape
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    w = w_int8 if w_int8.is_contiguous() else w_int8.contiguous()
    s = scale if scale.is_contiguous() else scale.contiguous()
    b = None if bias is None else bias.contiguous().data_ptr()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), m * n * k // MIN_WORK_PER_THREAD))
    lib.woq_int8_linear_f32(x2.data_ptr(), m, k, w.data_ptr(), s.data_ptr(), b, y.data_ptr(), n, threads)
    return y if x2 is x else y.reshape(*x.shape[:-1], n)


def _op_impl(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ (w_int8 * scale[:, None]).T (+ bias)``: the C++ kernel or the ATen reference (see module)."""
    _check(x, w_int8, scale, bias)
    how = chosen_backend(x, w_int8, scale, bias)
    if how == "native":
        return native(x, w_int8, scale, bias)
    if how == "dequant":
        return torch.nn.functional.linear(x, w_int8.float() * scale[:, None], bias)
    return reference(x, w_int8, scale, bias)


def _op_fake(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    _check(x, w_int8, scale, bias)
    return x.new_empty((*x.shape[:-1], w_int8.shape[0]))


# Declared with torch.library's low-level API rather than @custom_op: a decode step makes ~85 of these
# calls, and custom_op's Python wrapping measured ~11 us per call against ~2 us for a plain kernel.
# Inference only: there is no autograd formula (the weights are integer codes).
_LIB = torch.library.Library("fxforge", "FRAGMENT")
_LIB.define("int8_weight_only_linear(Tensor x, Tensor w_int8, Tensor scale, Tensor? bias) -> Tensor")
_LIB.impl("int8_weight_only_linear", _op_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fxforge::int8_weight_only_linear", _op_fake, lib=_LIB)


def int8_weight_only_linear(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ (w_int8 * scale[:, None]).T (+ bias)`` with ``w_int8`` [N, K] int8 and ``scale`` [N] fp32."""
    return torch.ops.fxforge.int8_weight_only_linear.default(x, w_int8, scale, bias)


def error_bound(x: Tensor, w_int8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Per-output bound on ``|y - exact|`` in fp32: ``g (scale_n sum_k |x_k||w_nk| + |bias_n|)``.

    ``g = n u / (1 - n u)`` with ``u = 2^-24`` and ``n = K + 2`` roundings (the K-term sum in any order,
    the scale product, the bias add): the standard dot-product bound, computed in float64 here.
    """
    k = w_int8.shape[1]
    mag = (x.double().abs().reshape(-1, k) @ w_int8.double().abs().T) * scale.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    nu = (k + 2) * 2.0**-24
    return (mag * (nu / (1 - nu))).reshape(*x.shape[:-1], w_int8.shape[0])
