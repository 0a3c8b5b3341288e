"""Quantized layers swapped in for nn.Linear / Conv1d / Conv2d / LayerNorm / Embedding by the quantize pass.

Each keeps the original parameters (shared, so QAT trains them) and holds one :class:`Quantize`
per configured role: ``data_in`` on the input, ``weight``/``bias`` on the parameters (re-quantized
every call, so training sees the quantized weights through the STE), ``data_out`` on the output.
Subclassing the float layer keeps selectors and canonical op names (``linear``...) working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, overload

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets
from .config import OpQuantConfig
from .quantizer import Quantize

__all__ = ["QuantizedLinear", "QuantizedConv1d", "QuantizedConv2d", "QuantizedEmbedding", "QuantizedLayerNorm",
           "QUANTIZED_LAYERS", "build_quantized_layer", "layer_roles", "register_quantized_layer"]

ROLE_ATTRS: dict[str, str] = {r: f"{r}_quantizer" for r in ("data_in", "weight", "bias", "data_out")}


class _QuantizedLayer(nn.Module):
    """Shared bookkeeping: the op config, one quantizer per role, JSON (de)serialisation (a mix-in, first base
    of a float layer subclass, whose parameters it declares)."""

    weight: torch.Tensor
    bias: torch.Tensor | None  # None for a layer built without one (and for an embedding, which has none)
    data_in_quantizer: Quantize | None  # one per role (ROLE_ATTRS), set by _init_quantizers
    weight_quantizer: Quantize | None
    bias_quantizer: Quantize | None
    data_out_quantizer: Quantize | None

    # (channel_axis, block_axis) per role; layers override.
    AXES: dict[str, tuple[int, int]] = {"data_in": (-1, -1), "weight": (0, -1), "bias": (0, -1),
                                        "data_out": (-1, -1)}
    ROLES: tuple[str, ...] = tuple(ROLE_ATTRS)  # the roles this layer has; configured others are ignored

    def _init_quantizers(self, quant: OpQuantConfig | Mapping[str, Any],
                         quantizers: Mapping[str, Mapping[str, Any]] | None, has_bias: bool) -> None:
        self.quant = quant if isinstance(quant, OpQuantConfig) else OpQuantConfig.from_json(quant)
        for role, attr in ROLE_ATTRS.items():
            spec = self.quant.role(role)
            module: Quantize | None = None
            if role in self.ROLES and quantizers is not None and role in quantizers:
                module = Quantize.from_config(quantizers[role])
            elif role in self.ROLES and spec is not None and (role != "bias" or has_bias):
                channel, block = self.AXES[role]
                module = Quantize(spec, role, is_param=role in ("weight", "bias"), channel_axis=channel,
                                  block_axis=block)
            setattr(self, attr, module)

    def quantizers(self) -> dict[str, Quantize]:
        """role -> quantizer, for the configured roles."""
        return {r: q for r, a in ROLE_ATTRS.items() if isinstance(q := getattr(self, a, None), Quantize)}

    @overload
    def _q(self, role: str, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def _q(self, role: str, x: None) -> None: ...

    @overload
    def _q(self, role: str, x: torch.Tensor | None) -> torch.Tensor | None: ...

    def _q(self, role: str, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` through the role's quantizer (unchanged for a role without one, None stays None)."""
        q = getattr(self, ROLE_ATTRS[role])
        return x if q is None or x is None else q(x)

    @classmethod
    def from_float(cls, layer: nn.Module, quant: OpQuantConfig) -> Any:
        """The quantized twin of ``layer``: built on the meta device from the float layer's constructor config
        (the one checkpoints store), then taking its parameters."""
        config = {k: tuple(v) if isinstance(v, list) else v for k, v in _FLOAT_CONFIGS[cls](layer).items()}
        build: Callable[..., _QuantizedLayer] = cls  # each layer's constructor takes its float config and quant
        with torch.device("meta"):
            new = build(**config, quant=quant)
        return new._adopt(layer)

    def _adopt(self, layer: nn.Module) -> Any:
        """Take ``layer``'s parameters (shared) and mode; quantizers are rebuilt on its device."""
        for name in ("weight", "bias"):  # as the float layer holds them (an embedding has no bias, a LayerNorm
            if hasattr(layer, name):     # without elementwise_affine holds None for both)
                setattr(self, name, getattr(layer, name))
        self._init_quantizers(self.quant, None, getattr(layer, "bias", None) is not None)
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        for q in self.quantizers().values():
            q.to(device)
        self.train(layer.training)
        return self

    def quant_config(self) -> dict[str, Any]:
        return {"quant": self.quant.to_json(), "quantizers": {r: q.to_config() for r, q in self.quantizers().items()}}


class QuantizedLinear(_QuantizedLayer, nn.Linear):  # type: ignore[misc]  # torch types Linear.bias non-Optional
    """``F.linear(q_in(x), q_w(W), q_b(b))`` followed by ``q_out``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias)
        if quant is None:
            raise ValueError("QuantizedLinear needs a quantization config")
        self._init_quantizers(quant, quantizers, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._q("data_in", x), self._q("weight", self.weight), self._q("bias", self.bias))
        return self._q("data_out", y)


class _QuantizedConv(_QuantizedLayer):
    """Shared conv forward: weights are quantized flattened to (out, in * kernel) along the reduction."""

    AXES = {"data_in": (1, 1), "weight": (0, -1), "bias": (0, -1), "data_out": (1, 1)}

    def _quantized_conv(self, x: torch.Tensor, conv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                                                               torch.Tensor]) -> torch.Tensor:
        """``conv`` (the float layer's own ``_conv_forward``) on the quantized input, weight and bias."""
        w = self.weight
        wq = self._q("weight", w.flatten(1))
        return self._q("data_out", conv(self._q("data_in", x), wq.view_as(w), self._q("bias", self.bias)))


class QuantizedConv1d(_QuantizedConv, nn.Conv1d):
    """Conv1d with quantized input, weight, bias and output."""

    def __init__(self, *args: Any, quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any) -> None:
        nn.Conv1d.__init__(self, *args, **kwargs)
        if quant is None:
            raise ValueError("QuantizedConv1d needs a quantization config")
        self._init_quantizers(quant, quantizers, self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_conv(x, self._conv_forward)


class QuantizedConv2d(_QuantizedConv, nn.Conv2d):
    """Conv2d with quantized input, weight, bias and output."""

    def __init__(self, *args: Any, quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        if quant is None:
            raise ValueError("QuantizedConv2d needs a quantization config")
        self._init_quantizers(quant, quantizers, self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._quantized_conv(x, self._conv_forward)


class QuantizedLayerNorm(_QuantizedLayer, nn.LayerNorm):
    """LayerNorm with quantized input, affine weight/bias and output."""

    AXES = {"data_in": (-1, -1), "weight": (-1, -1), "bias": (-1, -1), "data_out": (-1, -1)}
    weight: torch.Tensor | None  # type: ignore[assignment]  # None without elementwise_affine (torch types a Parameter)
    bias: torch.Tensor | None  # type: ignore[assignment]  # None without elementwise_affine or bias

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        nn.LayerNorm.__init__(self, normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias)
        if quant is None:
            raise ValueError("QuantizedLayerNorm needs a quantization config")
        self._init_quantizers(quant, quantizers, self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(self._q("data_in", x), self.normalized_shape, self._q("weight", self.weight),
                         self._q("bias", self.bias), self.eps)
        return self._q("data_out", y)


class QuantizedEmbedding(_QuantizedLayer, nn.Embedding):
    """Embedding lookup of a quantized table (weight role only: indices are not quantized).

    Formats whose quantization of a row depends only on that row (fixed point, minifloat, block / MX formats
    along the row, per-row scaled integers) quantize just the rows looked up, which equals looking up the
    quantized table without re-quantizing all of it on every call; per-tensor scaled formats quantize the table.
    """

    ROLES = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, quant: OpQuantConfig | Mapping[str, Any] | None = None,
                 quantizers: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        nn.Embedding.__init__(self, num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                              scale_grad_by_freq, sparse)
        if quant is None:
            raise ValueError("QuantizedEmbedding needs a quantization config")
        self._init_quantizers(quant, quantizers, False)

    def _row_local(self, q: Quantize) -> bool:
        return self.max_norm is None and (not q.fmt.scaled or q.per_channel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.weight_quantizer
        if not isinstance(q, Quantize) or not self._row_local(q):
            weight = self._q("weight", self.weight)
            return F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                               self.sparse)
        rows = F.embedding(x, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)
        return q(rows.reshape(-1, self.embedding_dim)).reshape(rows.shape)


QUANTIZED_LAYERS: dict[type[nn.Module], type[_QuantizedLayer]] = {
    nn.Linear: QuantizedLinear,
    nn.Embedding: QuantizedEmbedding,
    nn.Conv1d: QuantizedConv1d,
    nn.Conv2d: QuantizedConv2d,
    nn.LayerNorm: QuantizedLayerNorm,
}


def register_quantized_layer(float_cls: type[nn.Module], quantized_cls: type[_QuantizedLayer]) -> None:
    """Let the quantize pass swap ``float_cls`` (exact type) for ``quantized_cls`` (e.g. pruned layers, whose
    quantized twins keep their masks: passes/prune/quantized.py)."""
    old = QUANTIZED_LAYERS.get(float_cls)
    if old is not None and old is not quantized_cls:
        raise ValueError(f"{float_cls.__name__} already quantizes to {old.__name__}")
    QUANTIZED_LAYERS[float_cls] = quantized_cls


def build_quantized_layer(layer: nn.Module, quant: OpQuantConfig) -> nn.Module:
    """The quantized counterpart of a float layer (exact type match), sharing its parameters."""
    cls = QUANTIZED_LAYERS.get(type(layer))
    if cls is None:
        raise TypeError(f"no quantized layer for {type(layer).__name__}; supported: "
                        f"{[c.__name__ for c in QUANTIZED_LAYERS]}")
    return cls.from_float(layer, quant)


def layer_roles(layer: nn.Module) -> tuple[str, ...]:
    """The quantization roles ``layer``'s quantized counterpart has (e.g. an embedding only has ``weight``)."""
    cls = QUANTIZED_LAYERS.get(type(layer), type(layer))
    return tuple(getattr(cls, "ROLES", ROLE_ATTRS))


def _linear_config(m: Any) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}


def _conv_config(m: Any) -> dict[str, Any]:
    keys = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups", "padding_mode")
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(m, k)) for k in keys)}
    return {**out, "bias": m.bias is not None}


def _layer_norm_config(m: Any) -> dict[str, Any]:
    return {"normalized_shape": list(m.normalized_shape), "eps": m.eps,
            "elementwise_affine": m.elementwise_affine, "bias": m.bias is not None}


def _embedding_config(m: Any) -> dict[str, Any]:
    return {"num_embeddings": m.num_embeddings, "embedding_dim": m.embedding_dim, "padding_idx": m.padding_idx,
            "max_norm": m.max_norm, "norm_type": m.norm_type, "scale_grad_by_freq": m.scale_grad_by_freq,
            "sparse": m.sparse}


_FLOAT_CONFIGS: dict[type[nn.Module], Any] = {
    QuantizedLinear: _linear_config, QuantizedEmbedding: _embedding_config,
    QuantizedConv1d: _conv_config, QuantizedConv2d: _conv_config,
    QuantizedLayerNorm: _layer_norm_config,
}


def _register(cls: type[nn.Module]) -> None:
    float_config = _FLOAT_CONFIGS[cls]

    def to_config(m: Any) -> dict[str, Any]:
        return {**float_config(m), **m.quant_config()}

    def from_config(config: dict[str, Any]) -> nn.Module:
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
        return cls(**kw)

    targets.register_module(cls, to_config, from_config, name=f"fxforge.quantize.{cls.__name__}")


for _cls in QUANTIZED_LAYERS.values():
    _register(_cls)
