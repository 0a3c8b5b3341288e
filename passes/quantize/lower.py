"""Real int8: lower scaled-int8 quantized linears to CPU int8 GEMM kernels.

Simulation (quantize -> dequantize in fp32) never makes a model faster; this pass replaces every
:class:`QuantizedLinear` whose weight is 8-bit symmetric ``scaled_integer`` by :class:`Int8Linear`,
which stores int8 weights with per-output-channel scales and runs a real int8 kernel:

* ``fbgemm`` (default): ``quantized::linear_dynamic`` -- activations are quantized per tensor to
  uint8 on the fly inside the kernel (range of each batch), int8 x uint8 GEMM with int32
  accumulation, fp32 bias and output. Measured fastest on this CPU (benchmarks/bench_quant_int8.py).
* ``onednn``: ``onednn::qlinear_pointwise`` with the same dynamic per-tensor activation quantization
  done in torch ops before the call.

Activations are always quantized dynamically (per batch, asymmetric uint8), whatever the simulated
``data_in`` config was; weights keep the simulated per-channel (or per-tensor) symmetric scales, so
the lowered weights equal the simulated ones. The packed kernel weight is rebuilt lazily from the
int8 buffers, so the module checkpoints as plain int8/fp32 tensors (safetensors) and reloads exactly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from ...graph import targets
from ...graph.forge_graph import ForgeGraph
from ...graph.metadata import get_meta, has_meta
from ..base import forge_pass
from ..transform.inject import inject_modules
from .fixed import scale_zero_point, tensor_range
from .modules import QuantizedLinear
from .records import LoweringRecord, QuantizationRecord

__all__ = ["Int8Linear", "lower_int8_transform_pass", "LowerInt8Args", "BACKENDS", "lowerable"]

BACKENDS: tuple[str, ...] = ("fbgemm", "onednn")


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (per-output-channel scales) on a real int8 CPU kernel."""

    fxforge_op = "linear"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: str = "fbgemm",
                 reduce_range: bool = False) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown int8 backend {backend!r}; allowed: {list(BACKENDS)}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.backend, self.reduce_range = backend, bool(reduce_range)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._kernel: dict[str, Any] = {}  # packed weight (not a tensor attribute: never checkpointed)

    @classmethod
    def from_linear(cls, layer: nn.Linear, per_channel: bool = True, backend: str = "fbgemm",
                    reduce_range: bool = False) -> Int8Linear:
        """Quantize ``layer``'s weight symmetrically to int8 (narrow range [-127, 127])."""
        w = layer.weight.detach().float()
        lo, hi = tensor_range(w, 0 if per_channel else None)
        scale, _ = scale_zero_point(lo, hi, 8, symmetric=True)
        scale = scale.expand(w.shape[0]).contiguous() if scale.dim() == 0 else scale
        new = cls(layer.in_features, layer.out_features, layer.bias is not None, backend, reduce_range)
        new.weight_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        new.weight_scale = scale.float()
        if layer.bias is not None:
            new.bias = layer.bias.detach().float().clone()
        return new.to(w.device)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.float() * self.weight_scale[:, None]

    def _apply(self, fn: Any, recurse: bool = True) -> Int8Linear:
        self._kernel = {}  # device/dtype moves invalidate the packed kernel weight
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernel = {}
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_kernel"] = {}
        return state

    def _pack(self) -> Any:
        if "packed" not in self._kernel:
            zero = torch.zeros(self.out_features, dtype=torch.long)
            if self.backend == "fbgemm":
                with warnings.catch_warnings():  # quantized tensors are deprecated but fbgemm's prepack needs one
                    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
                    qw = torch._make_per_channel_quantized_tensor(self.weight_int8, self.weight_scale.double(),
                                                                  zero, 0)
                self._kernel["packed"] = torch.ops.quantized.linear_prepack(qw, self.bias)
            else:
                self._kernel["packed"] = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)
                self._kernel["zero"] = zero
        return self._kernel["packed"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._pack()
        if self.backend == "fbgemm":
            return torch.ops.quantized.linear_dynamic(x.float(), packed, self.reduce_range)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        lo, hi = torch.aminmax(x2)
        scale, zero_point = scale_zero_point(lo, hi, 8, symmetric=False)
        xq = torch.clamp(torch.round(x2 / scale) + zero_point, 0, 255).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise.tensor(
            xq, scale, zero_point.to(torch.int32), packed, self.weight_scale, self._kernel["zero"], self.bias, 1.0, 0,
            torch.float32, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.backend}")


targets.register_module(
    Int8Linear,
    lambda m: {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None,
               "backend": m.backend, "reduce_range": m.reduce_range},
    lambda c: Int8Linear(**c),
    name="fxforge.quantize.Int8Linear",
)


def lowerable(layer: nn.Module) -> str | None:
    """None if ``layer`` can become an Int8Linear, else the reason it cannot."""
    if not isinstance(layer, QuantizedLinear):
        return f"{type(layer).__name__} is not a QuantizedLinear"
    w = layer.quant.role("weight")
    if w is None or w.format != "scaled_integer" or w.p["width"] != 8 or not w.p["symmetric"]:
        return "weight is not 8-bit symmetric scaled_integer"
    x = layer.quant.role("data_in")
    if x is not None and (x.format != "scaled_integer" or x.p["width"] != 8):
        return "data_in is quantized but not to 8-bit scaled_integer"
    if layer.quant.role("data_out") is not None:
        return "data_out is quantized (the int8 kernel returns fp32)"
    return None


@dataclass(frozen=True)
class LowerInt8Args:
    """backend: ``fbgemm`` (quantized::linear_dynamic) or ``onednn`` (onednn::qlinear_pointwise);
    reduce_range: 7-bit activations (for CPUs without VNNI, whose 16-bit accumulation can saturate);
    strict: fail when a quantized linear cannot be lowered instead of leaving it simulated."""

    backend: Literal["fbgemm", "onednn"] = "fbgemm"
    reduce_range: bool = False
    strict: bool = False


@forge_pass("transform", LowerInt8Args)
def lower_int8_transform_pass(graph: ForgeGraph, args: LowerInt8Args) -> tuple[ForgeGraph, dict[str, Any]]:
    """Swap scaled-int8 QuantizedLinear layers for Int8Linear (real int8 kernels)."""
    gm = graph.model
    skipped: dict[str, str] = {}
    for name, module in gm.named_modules():
        if isinstance(module, QuantizedLinear) and (why := lowerable(module)) is not None:
            skipped[name] = why
    if skipped and args.strict:
        raise ValueError(f"cannot lower {len(skipped)} quantized linear(s) to int8: {skipped}")

    def build(name: str, module: nn.Module) -> nn.Module | None:
        if not isinstance(module, QuantizedLinear) or lowerable(module) is not None:
            return None
        w = module.quant.role("weight")
        assert w is not None
        return Int8Linear.from_linear(module, w.p["granularity"] == "per_channel", args.backend, args.reduce_range)

    done = inject_modules(gm, {"type": [QuantizedLinear]}, None, build, what="scaled-int8 quantized linear")
    lowered = {d.name for d in done}
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) in lowered and has_meta(node):
            meta = get_meta(node)
            meta.common.module_type = f"{Int8Linear.__module__}.{Int8Linear.__qualname__}"
            meta.software.set(LoweringRecord(kernel="quantized::linear_dynamic" if args.backend == "fbgemm"
                                             else "onednn::qlinear_pointwise"))
            rec = meta.software.get(QuantizationRecord)
            if rec is not None:
                rec.quantizers = {}  # the simulated quantizers are gone; the config stays as provenance
    return graph, {"lowered": len(done), "skipped": skipped, "backend": args.backend}
