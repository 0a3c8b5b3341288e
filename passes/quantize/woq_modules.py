"""Weight-only quantized layers on real CPU kernels: int8 per-row and int4 group-wise linears, low-bit embeddings.

Each holds its weight as integer codes at the kernel's width plus the scales the kernel reads, and nothing
else (no fp32 copy), so its resident weight memory is the packed size (:func:`resident_bytes`). Activations
stay floating point; the dequantized weight equals the simulated quantized weight exactly, and outputs
differ from the simulation only by rounding (see each layer's :meth:`error_bound`):

* :class:`WeightOnlyInt8Linear`: int8 codes, one fp32 scale per output row, run by
  ``fxforge.kernels.woq_int8.int8_weight_only_linear`` (fp32 activations, fp32 accumulation).
* :class:`WeightOnlyInt4Linear`: ATen's ``_weight_int4pack_mm_for_cpu``. Codes ``q + 8`` in 0..15, two per
  byte in the kernel's own blocked layout; per group of ``group_size`` inputs and output row a bf16
  (scale, zero) pair, the weight being ``(code - 8) * scale + zero`` (zero is 0 here: codes are symmetric).
  Activations run in bf16: the kernel's fp32 path is a scalar reference, ~50x slower than bf16 on this
  CPU class (measured: 1024x384 @ 384x1536 in 3.2 s fp32 vs 0.06-0.09 s bf16). Power-of-two scales are
  exact in bf16 (same exponent range as fp32), so only the activations and the output are rounded.
* :class:`WeightOnlyEmbedding`: a table of 4- or 8-bit codes with one fp32 scale per block of the row;
  a lookup dequantizes only the gathered rows.

The int4 layout depends on the CPU's vector width (ATen packs 64 rows per block with AVX512, 32 with
AVX2; probed, not assumed): a layer records the layout it was packed in and, run under another, repacks
itself once (when its rows fill the blocks; otherwise it refuses rather than compute garbage). From
``DENSE_FROM_ROWS`` rows on (prefill, encoders) ATen's int4 GEMM is no faster than fp32, so the layer
unpacks its weight to bf16 for the call and runs a bf16 GEMM (same roundings, same bound).
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets
from ...graph.packed import LoweredLayer, register_lowered
from ...kernels.woq_int8 import int8_weight_only_linear

__all__ = ["WeightOnlyInt8Linear", "WeightOnlyInt4Linear", "WeightOnlyEmbedding", "INT4_GROUP_SIZES",
           "int4_layout", "resident_bytes"]

INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
_U = 2.0**-24  # fp32 unit roundoff
_U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (what it keeps resident)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _unpack_rows(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Codes [N, K] (0..15) of ATen's int4 pack with ``block`` rows per block (N a multiple of it): per block and
    input, byte j holds row j in its low nibble and row block/2 + j in its high one."""
    t = packed.reshape(n // block, k, block // 2)
    return torch.cat([t & 15, t >> 4], dim=-1).transpose(1, 2).reshape(n, k)


@functools.cache
def int4_layout() -> str:
    """This process's int4 pack layout: ``rows64`` (AVX512) or ``rows32`` (AVX2), probed; else a fingerprint."""
    probe = (torch.arange(128 * 64, dtype=torch.int32, device="cpu").reshape(128, 64) * 7 + 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for block in (64, 32):
        if torch.equal(_unpack_rows(packed, 128, 64, block).to(torch.int32), probe):
            return f"rows{block}"
    return "sha" + hashlib.sha256(packed.numpy().tobytes()).hexdigest()[:16]


def _layout_block(layout: str) -> int | None:
    """Rows per block of a known layout (None for a fingerprinted one)."""
    return int(layout[4:]) if layout in ("rows64", "rows32") else None


def _accumulation_tol(k: int) -> float:
    """Relative bound of two fp32 dot products of length ``k`` summed in different orders, plus rescaling."""
    return (2 * k + 4) * _U


class WeightOnlyInt8Linear(nn.Module):
    """``x @ (weight_int8 * weight_scale[:, None]).T + bias`` with int8 codes and fp32 per-row scales."""

    fxforge_op = "linear"
    weight_int8: torch.Tensor  # buffers (registered in __init__)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> WeightOnlyInt8Linear:
        """From integer ``codes`` [N, K] in [-128, 127] and per-row ``scale`` [N]."""
        n, k = codes.shape
        new = cls(k, n, bias is not None)
        new.weight_int8 = codes.to(torch.int8).contiguous()
        new.weight_scale = scale.float().reshape(n).contiguous()
        new.bias = None if bias is None else bias.detach().float().clone()
        return new

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_weight_only_linear(x.float(), self.weight_int8, self.weight_scale, self.bias)
        return y.to(x.dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on |this layer - F.linear(x, dequantized_weight(), bias)| (fp32 order only)."""
        return _accumulation_tol(self.in_features) * _magnitude(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _magnitude(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``|x| @ |w|.T + |bias|`` in float64: the scale every rounding error of a linear is relative to."""
    out = x.double().abs() @ w.double().abs().T
    return out if bias is None else out + bias.double().abs()


class WeightOnlyInt4Linear(nn.Module):
    """int4 group-wise weights on ``_weight_int4pack_mm_for_cpu`` with bf16 activations (module docstring)."""

    fxforge_op = "linear"
    DENSE_FROM_ROWS = 256  # from this many rows, a bf16 GEMM on the unpacked weight (measured crossover)
    weight_int4pack: torch.Tensor  # buffers (registered in __init__)
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: bool = True,
                 layout: str = "") -> None:
        super().__init__()
        if group_size not in INT4_GROUP_SIZES or in_features % group_size or out_features % 16:
            raise ValueError(f"int4 weight-only linear needs group_size in {list(INT4_GROUP_SIZES)} dividing "
                             f"in_features ({in_features}) and out_features ({out_features}) a multiple of 16")
        self.in_features, self.out_features, self.group_size = int(in_features), int(out_features), int(group_size)
        self.layout = layout or int4_layout()
        self.register_buffer("weight_int4pack", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None) -> WeightOnlyInt4Linear:
        """From integer ``codes`` [N, K] in [-8, 7] and ``scale`` [N, K // group_size] (bf16-exact values)."""
        n, k = codes.shape
        new = cls(k, n, group_size, bias is not None)
        new.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            (codes.to(torch.int32) + 8).contiguous(), 1)
        sz = torch.stack([scale.float().T, torch.zeros(k // group_size, n)], dim=-1)
        new.scales_and_zeros = sz.to(torch.bfloat16).contiguous()
        new.bias = None if bias is None else bias.detach().float().clone()
        return new

    def codes(self) -> torch.Tensor | None:
        """The uint8 codes [N, K] (0..15) when this layer's layout is a known one and N fills its blocks."""
        block = _layout_block(self.layout)
        if block is None or self.out_features % block:
            return None
        return _unpack_rows(self.weight_int4pack, self.out_features, self.in_features, block)

    def _check_layout(self) -> None:
        """Repack (once) a layer packed under another CPU's layout, or refuse when its layout cannot be read."""
        if self.layout == int4_layout():
            return
        codes = self.codes()
        if codes is None or torch.compiler.is_compiling():
            raise RuntimeError(
                f"WeightOnlyInt4Linear was packed in int4 layout {self.layout} and this CPU's ATen uses "
                f"{int4_layout()} (the layout follows the vector width, AVX2 vs AVX512) and it cannot be repacked "
                f"here{' while tracing: run the layer once first' if codes is not None else ''}: re-run "
                "lower_weight_only_transform_pass on the simulated graph on this machine")
        self.weight_int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.layout = int4_layout()

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.weight_int4pack,
                                                          self.group_size, self.scales_and_zeros)

    def _bf16_weight(self) -> torch.Tensor | None:
        """The weight as bf16 (exact: (code - 8) * power-of-two scale + zero), unpacked in torch; None if unknown."""
        codes = self.codes()
        if codes is None:
            return None
        q = codes.to(torch.bfloat16).unflatten(1, (-1, self.group_size)) - 8
        sz = self.scales_and_zeros.transpose(0, 1).unsqueeze(2)  # [N, groups, 1, 2]
        return (q * sz[..., 0] + sz[..., 1]).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_layout()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        w = self._bf16_weight() if x2.shape[0] >= self.DENSE_FROM_ROWS else None
        # many rows: ATen's int4 GEMM (made for decode) is no faster than fp32; a bf16 GEMM on the weight
        # unpacked for this call is ~2x faster, with the same roundings (bf16 in, fp32 sums, bf16 out)
        y = self._mm(x2) if w is None else F.linear(x2.to(torch.bfloat16), w)
        y = y.to(x.dtype).reshape(*lead, self.out_features)
        # in place on this call's own output: a second output-sized allocation can cost as much as the GEMM
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight the kernel multiplies by: unpacked, or read back through the kernel itself (an identity
        input: each (code - 8) * scale is a bf16-exact power-of-two multiple, so the readback is exact)."""
        self._check_layout()
        w = self._bf16_weight()
        return w.float() if w is not None else self._mm(torch.eye(self.in_features)).float().T.contiguous()

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on |this layer - F.linear(x, dequantized_weight(), bias)|: bf16 rounding of the
        input and of the output (2^-8 each, relative), fp32 accumulation in another order, the bias added."""
        tol = 2 * _U_BF16 + _accumulation_tol(self.in_features)
        return tol * _magnitude(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, activations=bf16")


class WeightOnlyEmbedding(nn.Module):
    """An embedding table of ``width``-bit codes (4: two per byte, low nibble first; 8: int8) and one fp32
    scale per block of ``block_size`` along each row; a lookup dequantizes only the gathered rows."""

    fxforge_op = "embedding"
    codes: torch.Tensor  # buffers (registered in __init__)
    scale: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, width: int = 8, block_size: int = 0,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        block_size = block_size or embedding_dim
        if width not in (4, 8) or embedding_dim % block_size or (width == 4 and embedding_dim % 2):
            raise ValueError(f"WeightOnlyEmbedding: width must be 4 or 8 and block_size ({block_size}) divide "
                             f"embedding_dim ({embedding_dim}), even for width 4")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.width, self.block_size, self.padding_idx = int(width), int(block_size), padding_idx
        cols = embedding_dim // 2 if width == 4 else embedding_dim
        dtype = torch.uint8 if width == 4 else torch.int8
        self.register_buffer("codes", torch.zeros(num_embeddings, cols, dtype=dtype))
        self.register_buffer("scale", torch.ones(num_embeddings, embedding_dim // block_size))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, width: int,
                   padding_idx: int | None = None) -> WeightOnlyEmbedding:
        """From integer ``codes`` [V, D] (signed, within ``width`` bits) and ``scale`` [V, D // block_size]."""
        v, d = codes.shape
        new = cls(v, d, width, d // scale.shape[1], padding_idx)
        if width == 4:
            nib = (codes.to(torch.int16) & 15).to(torch.uint8)
            new.codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
        else:
            new.codes = codes.to(torch.int8).contiguous()
        new.scale = scale.float().contiguous()
        return new

    def _rows(self, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Dequantize gathered code rows [..., cols] with their scales [..., blocks]."""
        if self.width == 4:
            lo = (rows & 15).to(torch.int8)
            hi = (rows >> 4).to(torch.int8)
            q = torch.stack([lo, hi], dim=-1).flatten(-2)
            q = torch.where(q > 7, q - 16, q)
        else:
            q = rows
        q = q.float().unflatten(-1, (-1, self.block_size))
        return (q * scale.unsqueeze(-1)).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(F.embedding(x, self.codes), F.embedding(x, self.scale))

    def dequantized_weight(self) -> torch.Tensor:
        return self._rows(self.codes, self.scale)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, width={self.width}, block_size={self.block_size}, "
                f"padding_idx={self.padding_idx}")


targets.register_module(
    WeightOnlyInt8Linear,
    lambda m: {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None},
    lambda c: WeightOnlyInt8Linear(**c),
    name="fxforge.quantize.WeightOnlyInt8Linear",
)
targets.register_module(
    WeightOnlyInt4Linear,
    lambda m: {"in_features": m.in_features, "out_features": m.out_features, "group_size": m.group_size,
               "bias": m.bias is not None, "layout": m.layout},
    lambda c: WeightOnlyInt4Linear(**c),
    name="fxforge.quantize.WeightOnlyInt4Linear",
)
targets.register_module(
    WeightOnlyEmbedding,
    lambda m: {"num_embeddings": m.num_embeddings, "embedding_dim": m.embedding_dim, "width": m.width,
               "block_size": m.block_size, "padding_idx": m.padding_idx},
    lambda c: WeightOnlyEmbedding(**c),
    name="fxforge.quantize.WeightOnlyEmbedding",
)



def _numel(m: nn.Module, attr: str) -> int:
    t = getattr(m, attr, None)
    return 0 if t is None else int(t.numel())


def _bias_bits(m: nn.Module) -> dict[str, float]:
    return {"bias": 32.0 * _numel(m, "bias")} if getattr(m, "bias", None) is not None else {}


def int8_linear_bits(m: nn.Module) -> dict[str, float]:
    """int8 codes (8 bits each), the fp32 scale per row the kernel multiplies by, the fp32 bias."""
    return {"weight_int8": 8.0 * _numel(m, "weight_int8"), "weight_scale": 32.0 * _numel(m, "weight_scale"),
            **_bias_bits(m)}


def _int4_linear_bits(m: nn.Module) -> dict[str, float]:
    """4 bits per weight (two codes a byte), the bf16 (scale, zero) pair per group and row the kernel reads
    (the zeros are all 0 but ATen's kernel takes them), the fp32 bias."""
    assert isinstance(m, WeightOnlyInt4Linear)
    n, k = m.out_features, m.in_features
    return {"weight_int4pack": 4.0 * n * k, "scales_and_zeros": 16.0 * 2 * n * (k // m.group_size), **_bias_bits(m)}


def _embedding_bits(m: nn.Module) -> dict[str, float]:
    """``width`` bits per entry, an fp32 scale per block of a row."""
    assert isinstance(m, WeightOnlyEmbedding)
    v, d = m.num_embeddings, m.embedding_dim
    return {"codes": float(m.width * v * d), "scale": 32.0 * v * (d // m.block_size)}


register_lowered(LoweredLayer("fxforge.quantize.WeightOnlyInt8Linear", WeightOnlyInt8Linear,
                              ("weight_int8", "weight_scale", "bias"), int8_linear_bits))
register_lowered(LoweredLayer("fxforge.quantize.WeightOnlyInt4Linear", WeightOnlyInt4Linear,
                              ("weight_int4pack", "scales_and_zeros", "bias"), _int4_linear_bits))
register_lowered(LoweredLayer("fxforge.quantize.WeightOnlyEmbedding", WeightOnlyEmbedding, ("codes", "scale"),
                              _embedding_bits))
