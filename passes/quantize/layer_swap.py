"""The module-swapping core of quantization, shared by the graph pass and the module pass.

Given a module's path, the module and its canonical op, :func:`plan_layer_swap` decides with MASE's config
lookup (``QuantizeConfig.rule_for``) what the module becomes: a quantized layer (``modules.py``), a wrapper
whose wrapped layer is quantized (LoRA's ``fxforge_wraps``) or a :class:`QuantizedSDPA`. The graph pass
(``transform.py``) applies plans to the call_module nodes of a captured graph; ``quantize_module_transform_pass``
(``module_pass.py``) applies them to ``named_modules()`` of a model that cannot be captured. One decision,
two entry points: the same config quantizes the same layers the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ...graph.ir import module_op_name
from ...graph.modules import ScaledDotProductAttention
from .attention import QuantizedSDPA
from .config import OpQuantConfig, QuantizeConfig
from .modules import QUANTIZED_LAYERS, build_quantized_layer

__all__ = ["LAYER_OPS", "SDPA", "LayerSwap", "layer_quantizer_paths", "plan_layer_swap", "sdpa_configs"]

SDPA = "scaled_dot_product_attention"
LAYER_OPS = ("linear", "conv1d", "conv2d", "layer_norm", "embedding")


@dataclass(frozen=True)
class LayerSwap:
    """What one module becomes: ``build(old) -> new``, and the record the graph pass writes for it.

    ``wrapped``: the attribute of a wrapper (LoRA) whose layer is quantized (the wrapper stays, its adapter float).
    """

    op: str
    format: str
    config: dict[str, Any]
    rule: str | None
    build: Callable[[nn.Module], nn.Module]
    wrapped: str | None = None


def _sdpa_module(mm: OpQuantConfig | None, sm: OpQuantConfig | None) -> Callable[[nn.Module], nn.Module]:
    def build(m: nn.Module) -> nn.Module:
        assert isinstance(m, ScaledDotProductAttention)
        new = QuantizedSDPA(m.dropout_p, m.is_causal, m.scale, m.enable_gqa, mm, sm)
        return new.train(m.training)
    return build


def _quantize_wrapped(module: nn.Module, attr: str, cfg: OpQuantConfig) -> nn.Module:
    """Quantize the layer a wrapper (LoraLinear's ``base``) holds; the wrapper stays."""
    setattr(module, attr, build_quantized_layer(getattr(module, attr), cfg))
    return module


def _unquantizable(where: str, module: nn.Module, op: str) -> ValueError:
    return ValueError(f"{where}: cannot quantize a {type(module).__name__} as {op!r}; quantizable layers: "
                      f"{[c.__name__ for c in QUANTIZED_LAYERS]}. Exclude it with by='name'/'regex' or a name "
                      "entry with name None")


def sdpa_configs(config: QuantizeConfig, name: str, module: nn.Module | None
                 ) -> tuple[list[str], str | None, OpQuantConfig | None, OpQuantConfig | None]:
    """(rule keys used, the record's rule, matmul config, softmax config) of an attention: ``by: type`` takes the
    ``matmul`` and ``softmax`` entries, ``by: name/regex`` one entry for both."""
    if config.by == "type":
        k1, mm = config.rule_for(name, "matmul", module)
        k2, sm = config.rule_for(name, "softmax", module)
        return [k for k in (k1, k2) if k is not None], k1 or k2, mm, sm
    rule, mm = config.rule_for(name, SDPA, module)
    return [rule] if rule is not None else [], rule, mm, mm


def plan_layer_swap(name: str, module: nn.Module, op: str, config: QuantizeConfig,
                    where: str) -> tuple[bool, list[str], LayerSwap | None]:
    """(handled, rule keys used, swap or None) for the module at ``name`` whose canonical op is ``op``.

    ``handled`` is False for modules that are not layers (e.g. an ``nn.ReLU`` module): the graph pass quantizes
    those as functions (quantizers around the node). ``where`` names the module in errors (node and path).
    """
    if isinstance(module, ScaledDotProductAttention):
        rules, rule, mm, sm = sdpa_configs(config, name, module)
        first = mm if mm is not None else sm
        if first is None:
            return True, rules, None
        cfg_json = {"matmul": mm.to_json() if mm else None, "softmax": sm.to_json() if sm else None}
        return True, rules, LayerSwap(SDPA, first.format, cfg_json, rule, _sdpa_module(mm, sm))
    wrapped = getattr(type(module), "fxforge_wraps", None)
    if wrapped is not None:  # e.g. LoraLinear: quantize the layer it wraps, the adapter stays float
        inner = getattr(module, wrapped)
        inner_op = module_op_name(inner)
        rule, cfg = config.rule_for(name, inner_op, inner)
        rules = [rule] if rule is not None else []
        if cfg is None or inner_op not in LAYER_OPS:
            return True, rules, None
        if type(inner) not in QUANTIZED_LAYERS:
            raise ValueError(f"{where}: cannot quantize the {type(inner).__name__} wrapped by "
                             f"{type(module).__name__}; quantizable: {[c.__name__ for c in QUANTIZED_LAYERS]}")
        build = functools.partial(_quantize_wrapped, attr=wrapped, cfg=cfg)
        return True, rules, LayerSwap(inner_op, cfg.format, cfg.to_json(), rule, build, wrapped)
    if op not in LAYER_OPS:
        return False, [], None
    rule, cfg = config.rule_for(name, op, module)
    rules = [rule] if rule is not None else []
    if cfg is None:
        return True, rules, None
    if type(module) not in QUANTIZED_LAYERS:
        raise _unquantizable(where, module, op)
    return True, rules, LayerSwap(op, cfg.format, cfg.to_json(), rule,
                                  functools.partial(build_quantized_layer, quant=cfg))


def layer_quantizer_paths(name: str, swap: LayerSwap, new: nn.Module) -> dict[str, str]:
    """role / slot -> path of each quantizer the swapped-in module at ``name`` holds (for the record)."""
    layer = getattr(new, swap.wrapped) if swap.wrapped is not None else new
    prefix = f"{name}.{swap.wrapped}" if swap.wrapped is not None else name
    quantizers = getattr(layer, "quantizers", None)
    return {slot: f"{prefix}.{slot}_quantizer" for slot in (quantizers() if quantizers is not None else {})}
