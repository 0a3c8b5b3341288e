"""Masked layers: ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` whose pruned weights stay exactly zero.

The prune pass swaps a selected layer for its ``Pruned*`` twin, which keeps the same parameters and
adds boolean buffers ``weight_mask`` (and ``bias_mask``). The forward multiplies by the masks, so the
gradient of a pruned weight is zero and (since the stored weight was zeroed too) SGD / Adam / AdamW
never move it: pruned weights stay exactly zero through HF-Trainer training. Subclassing the float layer
keeps selectors, canonical op names (``linear``) and LoRA (which wraps any nn.Linear) working;
quantization swaps a PrunedLinear for QuantizedPrunedLinear (passes/prune/quantized.py), which keeps
the masks. Activation pruning (MASE) masks the layer's input at run time.
"""

from __future__ import annotations

from typing import Any, Self, TypeGuard

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...graph import targets

__all__ = ["MaskedLayer", "PrunableLayer", "PrunedLinear", "PrunedConv1d", "PrunedConv2d", "PRUNED_LAYERS",
           "pruned_from", "is_masked", "is_prunable", "layer_weight"]

def activation_mask(x: torch.Tensor, sparsity: float, method: str, scope: str = "local") -> torch.Tensor:
    """Keep the ``1 - sparsity`` largest |x| of each row (``local``; last dim) or of the whole tensor
    (``global``) -- or a random subset -- at run time."""
    if method == "random":
        return (torch.rand_like(x) >= sparsity).to(x.dtype)
    mag = x.detach().abs()
    flat = mag.reshape(-1) if scope == "global" else mag
    drop = int(round(sparsity * flat.shape[-1]))
    if drop <= 0:
        return torch.ones_like(x)
    threshold = flat.kthvalue(drop, dim=-1, keepdim=True).values
    return (mag > (threshold if scope != "global" else threshold.reshape(()))).to(x.dtype)


class MaskedLayer(nn.Module):
    """Shared mask bookkeeping of the pruned layers (a mix-in, first base of a float layer subclass)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_mask: torch.Tensor  # bool buffers, registered by _init_masks
    bias_mask: torch.Tensor | None
    act_sparsity: float
    act_method: str
    act_scope: str

    def _init_masks(self, act_sparsity: float = 0.0, act_method: str = "l1", act_scope: str = "local") -> None:
        self.register_buffer("weight_mask", torch.ones_like(self.weight, dtype=torch.bool))
        bias = self.bias
        self.register_buffer("bias_mask", None if bias is None else torch.ones_like(bias, dtype=torch.bool))
        self.act_sparsity, self.act_method, self.act_scope = float(act_sparsity), str(act_method), str(act_scope)

    def set_masks(self, weight_mask: torch.Tensor, bias_mask: torch.Tensor | None = None) -> None:
        """AND new masks into the current ones and zero the pruned stored values."""
        with torch.no_grad():
            self.weight_mask &= weight_mask.to(torch.bool)
            self.weight.mul_(self.weight_mask)
            if self.bias is not None and bias_mask is not None:
                kept = self.existing_bias_mask()
                kept &= bias_mask.to(torch.bool)
                self.bias.mul_(kept)

    def masked_weight(self) -> torch.Tensor:
        return self.weight * self.weight_mask

    def masked_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias * self.existing_bias_mask()

    def existing_bias_mask(self) -> torch.Tensor:
        """The bias mask of a layer that has a bias (``_init_masks`` registers one with the bias)."""
        if self.bias_mask is None:
            raise RuntimeError(f"{type(self).__name__} has a bias but no bias_mask buffer (build it with "
                               "from_float or its constructor)")
        return self.bias_mask

    def masked_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_sparsity <= 0:
            return x
        return x * activation_mask(x, self.act_sparsity, self.act_method, self.act_scope)

    def _adopt_masked(self, layer: nn.Linear | nn.Conv1d | nn.Conv2d) -> Self:
        """Take ``layer``'s parameters (shared, not copied) and training mode; masks start all-kept."""
        self.weight, self.bias = layer.weight, layer.bias
        self._init_masks()
        self.train(layer.training)
        return self

    def mask_config(self) -> dict[str, Any]:
        return {"act_sparsity": self.act_sparsity, "act_method": self.act_method, "act_scope": self.act_scope}

    def extra_repr_masks(self) -> str:
        kept = int(self.weight_mask.sum())
        return f"kept={kept}/{self.weight_mask.numel()}, act_sparsity={self.act_sparsity:g}"


class PrunedLinear(MaskedLayer, nn.Linear):  # type: ignore[misc]  # torch types Linear.bias non-Optional
    """``F.linear(act_mask(x), W * weight_mask, b * bias_mask)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, act_sparsity: float = 0.0,
                 act_method: str = "l1", act_scope: str = "local") -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias)
        self._init_masks(act_sparsity, act_method, act_scope)

    @classmethod
    def from_float(cls, layer: nn.Linear) -> PrunedLinear:
        with torch.device("meta"):
            new = cls(layer.in_features, layer.out_features, layer.bias is not None)
        return new._adopt_masked(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.masked_input(x), self.masked_weight(), self.masked_bias())

    def extra_repr(self) -> str:
        return f"{nn.Linear.extra_repr(self)}, {self.extra_repr_masks()}"


_CONV_KEYS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
              "padding_mode")


class _PrunedConv(MaskedLayer):
    @classmethod
    def from_float(cls, layer: nn.Conv1d | nn.Conv2d) -> Self:
        kw = {k: getattr(layer, k) for k in _CONV_KEYS}
        with torch.device("meta"):
            new = cls(**kw, bias=layer.bias is not None)
        return new._adopt_masked(layer)


class PrunedConv1d(_PrunedConv, nn.Conv1d):
    """Conv1d with weight / bias masks."""

    def __init__(self, *args: Any, act_sparsity: float = 0.0, act_method: str = "l1", act_scope: str = "local",
                 **kwargs: Any) -> None:
        nn.Conv1d.__init__(self, *args, **kwargs)
        self._init_masks(act_sparsity, act_method, act_scope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.masked_input(x), self.masked_weight(), self.masked_bias())


class PrunedConv2d(_PrunedConv, nn.Conv2d):
    """Conv2d with weight / bias masks."""

    def __init__(self, *args: Any, act_sparsity: float = 0.0, act_method: str = "l1", act_scope: str = "local",
                 **kwargs: Any) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        self._init_masks(act_sparsity, act_method, act_scope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self.masked_input(x), self.masked_weight(), self.masked_bias())


PrunableLayer = nn.Linear | nn.Conv1d | nn.Conv2d  # what pruning masks (masked twins are subclasses)
PRUNED_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: PrunedLinear, nn.Conv1d: PrunedConv1d, nn.Conv2d: PrunedConv2d,
}


def pruned_from(layer: nn.Module) -> MaskedLayer | None:
    """The masked twin of ``layer`` (itself when already masked); None for other layers, subclasses of
    the float layers included (the exact types of :data:`PRUNED_LAYERS`)."""
    if isinstance(layer, MaskedLayer):
        return layer
    if type(layer) is nn.Linear:
        return PrunedLinear.from_float(layer)
    if type(layer) is nn.Conv1d:
        return PrunedConv1d.from_float(layer)
    if type(layer) is nn.Conv2d:
        return PrunedConv2d.from_float(layer)
    return None


def is_masked(layer: nn.Module) -> TypeGuard[MaskedLayer]:
    """Whether ``layer`` carries pruning masks (a :class:`MaskedLayer`)."""
    return isinstance(layer, MaskedLayer)


def is_prunable(layer: nn.Module) -> TypeGuard[PrunableLayer]:
    """Whether the prune pass can mask ``layer``: masked already, or exactly a layer of :data:`PRUNED_LAYERS`."""
    return isinstance(layer, nn.Linear | nn.Conv1d | nn.Conv2d) and (is_masked(layer) or type(layer) in PRUNED_LAYERS)


def layer_weight(layer: nn.Module) -> torch.Tensor:
    """The ``weight`` tensor of a layer the dependency groups name (a Linear / Conv, masked or not)."""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"pruning reads the weight of each grouped layer; a {type(layer).__name__} has "
                        f"{'no weight' if weight is None else 'a ' + type(weight).__name__ + ' as weight'}")
    return weight


def _linear_config(m: PrunedLinear) -> dict[str, Any]:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None,
            **m.mask_config()}


def _conv_config(m: PrunedConv1d | PrunedConv2d) -> dict[str, Any]:
    out = {k: list(v) if isinstance(v, tuple) else v for k in _CONV_KEYS if (v := getattr(m, k)) is not None}
    return {**out, "bias": m.bias is not None, **m.mask_config()}


def _conv_from(cls: type[nn.Module]) -> Any:
    def build(c: dict[str, Any]) -> nn.Module:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
    return build


targets.register_module(PrunedLinear, _linear_config, lambda c: PrunedLinear(**c), name="fxforge.PrunedLinear")
targets.register_module(PrunedConv1d, _conv_config, _conv_from(PrunedConv1d), name="fxforge.PrunedConv1d")
targets.register_module(PrunedConv2d, _conv_config, _conv_from(PrunedConv2d), name="fxforge.PrunedConv2d")
