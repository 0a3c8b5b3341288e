"""fxforge.int8_weight_only_linear: the C++ kernel and the ATen reference against float64, dispatch, build, export."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hf_tiny import tiny_hf

from fxforge.kernels import woq_int8 as W

Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def operands(m: int, k: int, n: int, bias: bool, lead: tuple[int, ...] = ()) -> Operands:
    """Random x, int8 codes spanning [-128, 127] (every row holds both ends), per-row scales, bias."""
    x = torch.randn(*lead, m, k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    w[:, 0], w[:, -1] = -128, 127
    scale = torch.rand(n) * 0.05 + 1e-3
    b = torch.randn(n) if bias else None
    return (x, w, scale, b)


def exact(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ (w * scale[:, None]).T + b in float64 (exact to ~1e-16 relative: the ground truth)."""
    y = x.double() @ (w.double() * scale.double()[:, None]).T
    return y if b is None else y + b.double()


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor,
                        b: torch.Tensor | None) -> None:
    err = (y.double() - exact(x, w, s, b)).abs()
    bound = W.error_bound(x, w, s, b)
    assert y.dtype == torch.float32 and y.shape == (*x.shape[:-1], w.shape[0])
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


def native_expected() -> bool:
    """Where the C++ kernel must be available: an AVX2+FMA CPU with a C++ compiler."""
    return W.cpu_supported() and shutil.which("g++") is not None


@pytest.fixture
def fresh_library() -> Iterator[None]:
    """Forget the loaded library before and after a test that changes how it is found."""
    W.native_library.cache_clear()
    yield
    W.native_library.cache_clear()


SHAPES = [(1, 771, 37), (5, 771, 37), (1, 64, 8), (5, 5, 3), (3, 2048, 130), (8, 768, 66), (40, 200, 29)]


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_float64_within_bound(backend: W.Backend, bias: bool, m: int, k: int, n: int) -> None:
    if backend == "native" and not native_expected():
        assert W.native_library() is None  # no AVX2/compiler: the op must fall back, checked below
        backend = "auto"
    x, w, s, b = operands(m, k, n, bias)
    with W.woq_int8_backend(backend):
        assert_within_bound(W.int8_weight_only_linear(x, w, s, b), x, w, s, b)


def test_native_kernel_is_available_here_and_chosen_for_decode() -> None:
    assert (W.native_library() is not None) == native_expected()
    x, w, s, b = operands(1, 768, 64, True)
    assert W.chosen_backend(x, w, s, b) == ("native" if native_expected() else "reference")
    assert W.chosen_backend(x.bfloat16(), w, s, b) == "reference"  # the kernel is fp32-only
    assert W.chosen_backend(torch.randn(40, 768), w, s, b) == W.chosen_backend(x, w, s, b)  # a prefill
    big = torch.randn(W.NATIVE_MAX_ROWS + 1, 768)
    assert W.chosen_backend(big, w, s, b) == "dequant"  # x beyond L2: MKL's GEMM on w * scale
    assert_within_bound(W.int8_weight_only_linear(big, w, s, b), big, w, s, b)
    with W.woq_int8_backend("reference"):
        assert W.chosen_backend(x, w, s, b) == "reference"
    with pytest.raises(RuntimeError, match="cannot run these operands"), W.woq_int8_backend("native"):
        W.int8_weight_only_linear(x.bfloat16(), w, s, b)
    with pytest.raises(ValueError, match="backend"), W.woq_int8_backend("fast"):  # type: ignore[arg-type]
        pass


def test_leading_dims_and_multithreaded_rows() -> None:
    torch.manual_seed(3)
    x, w, s, b = operands(3, 1000, 517, True, lead=(2,))  # 6 rows, 517 = 4 * 129 + 1 rows of w
    with W.woq_int8_backend("auto"):
        y = W.int8_weight_only_linear(x, w, s, b)
    assert_within_bound(y, x, w, s, b)
    with W.woq_int8_backend("reference"):
        ref = W.int8_weight_only_linear(x, w, s, b)
    assert_within_bound(ref, x, w, s, b)


def test_bf16_activations_run_the_reference() -> None:
    x, w, s, b = operands(2, 96, 16, True)
    xb = x.bfloat16()
    y = W.int8_weight_only_linear(xb, w, s, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, W.reference(xb, w, s, b))
    assert b is not None
    magnitude = exact(xb.abs(), w.abs(), s, b.abs())  # bf16 carries 8 bits: a few roundings of 2^-8
    assert ((y.double() - exact(xb, w, s, b)).abs() <= 2.0**-6 * magnitude).all()


def test_shape_errors_name_the_op() -> None:
    x, w, s, _ = operands(1, 32, 8, False)
    with pytest.raises(ValueError, match="int8_weight_only_linear"):
        W.int8_weight_only_linear(x, w, s[:4])
    with pytest.raises(ValueError, match="int8_weight_only_linear"):
        W.int8_weight_only_linear(x[:, :16], w, s)


def test_tiny_llama_projection_quantized_per_channel() -> None:
    """A real layer: tiny Llama's q_proj quantized to int8 per output channel, on its own hidden states."""
    model = tiny_hf("llama")
    lin = model.model.layers[0].self_attn.q_proj
    weight = lin.weight.detach()
    scale = weight.abs().amax(1) / 127
    codes = torch.clamp(torch.round(weight / scale[:, None]), -128, 127).to(torch.int8)
    with torch.no_grad():
        h = model.model.embed_tokens(torch.randint(0, 100, (1, 5)))
    y = W.int8_weight_only_linear(h, codes, scale, None)
    assert_within_bound(y, h, codes, scale, None)
    dequant = F.linear(h, codes.float() * scale[:, None])
    torch.testing.assert_close(y, dequant, rtol=1e-5, atol=1e-6)


def test_cpu_without_avx2_runs_the_reference(monkeypatch: pytest.MonkeyPatch, fresh_library: None) -> None:
    monkeypatch.setattr(W, "cpu_supported", lambda: False)
    assert W.native_library() is None
    x, w, s, b = operands(1, 100, 12, True)
    assert W.chosen_backend(x, w, s, b) == "reference"
    assert_within_bound(W.int8_weight_only_linear(x, w, s, b), x, w, s, b)


def test_build_failure_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  fresh_library: None) -> None:
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="failed"):
        W.build(bad, root=tmp_path)
    assert not list((tmp_path / "fxforge_woq_int8").glob("*.so"))  # no half-written library left
    real_build = W.build
    monkeypatch.setattr(W, "build", lambda: real_build(bad, root=tmp_path))
    x, w, s, b = operands(1, 40, 6, True)
    with pytest.warns(UserWarning, match="did not build") as caught:
        y = W.int8_weight_only_linear(x, w, s, b)
        W.int8_weight_only_linear(x, w, s, b)
    assert len([c for c in caught if "did not build" in str(c.message)]) == 1
    assert_within_bound(y, x, w, s, b)


def test_build_is_cached_by_source_hash(tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        with pytest.raises(RuntimeError, match="compiler"):
            W.build(root=tmp_path, compiler=None)
        return
    path = W.build(root=tmp_path)
    assert path == W.library_path(root=tmp_path) and path.parent.parent == tmp_path
    stamp = path.stat().st_mtime_ns
    assert W.build(root=tmp_path) == path and path.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    edited = tmp_path / "woq_int8.cpp"
    edited.write_text(W.SOURCE.read_text() + "\n// edited\n")
    assert W.library_path(edited, tmp_path) != path
    lib = W.load(path)
    assert lib.woq_int8_cpu_ok() == int(W.cpu_supported())


class Int8Linear(nn.Module):
    """A linear layer holding int8 codes and scales, calling the op (what the lowering produces)."""

    w: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return W.int8_weight_only_linear(x, self.w, self.scale, self.bias)


def test_torch_export_keeps_the_op() -> None:
    x, w, s, b = operands(1, 72, 24, True, lead=(1,))
    mod = Int8Linear(w, s, b)
    ep = torch.export.export(mod, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.fxforge.int8_weight_only_linear.default in targets
    x2 = torch.randn(1, 1, 72)
    assert torch.equal(ep.module()(x2), mod(x2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_within_bound(ep.module()(x2), x2, w, s, b)
