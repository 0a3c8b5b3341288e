"""Real int8: lower scaled-int8 quantized linears to CPU int8 GEMM kernels.

Simulation (quantize -> dequantize in fp32) never makes a model faster; this pass replaces every
:class:`QuantizedLinear` whose weight is 8-bit symmetric ``scaled_integer`` by :class:`Int8Linear`,
which stores int8 weights with per-output-channel (or per-tensor) scales and runs a real kernel:

* ``onednn`` (``auto`` picks it when this torch build has it): ``onednn::qlinear_pointwise``
  (AMX / VNNI int8 GEMM, int32 accumulation, fp32 bias and output). The input is quantized to uint8
  per tensor with the *calibrated* scale of the simulated ``data_in`` quantizer (static, as in the
  simulation: asymmetric ranges keep their zero point, symmetric ones use zero point 128), or per
  batch when it is dynamic (as the simulated quantizer: ``input_scheme``, :mod:`.int8_input`; lowered ==
  simulated up to fp32 rounding) or not quantized (``quantize_per_tensor_dynamic``).
* ``fbgemm``: ``quantized::linear_dynamic`` -- always dynamic per-tensor uint8 inputs, quantized
  inside the kernel.

x86 CPUs without VNNI/AMX (AVX2 or plain AVX512) compute u8 x s8 products with ``vpmaddubsw``, which
sums adjacent pairs into int16 and *saturates*: 8-bit input codes near 255 times weights near 127
give wrong sums (errors of ~25% of the output, measured on an AVX2 EPYC). :func:`int8_kernel_saturates`
probes each backend's kernel once per process; where it saturates, inputs are quantized to 7 bits
(codes 0..127, pairs <= 2 * 127 * 127 < 2**15) -- PyTorch's x86 qconfigs' ``reduce_range`` -- so the
kernel result is the exact integer product on every CPU (dynamic inputs then take 7-bit
``quantize_per_tensor_dynamic`` codes, not the simulated ones). The decision is made when the kernel
runs, not when the graph is lowered, so a checkpoint lowered on a VNNI machine stays right on an AVX2 one.

On a Sapphire Rapids CPU (2 cores) onednn with static inputs was fastest; see
``benchmarks/bench_quant_int8.py``. Both paths build transient quantized tensors
(``quantize_per_tensor``, fbgemm's prepack), which torch 2.13 deprecates; the warnings are
silenced here. The packed kernel weight is rebuilt lazily from the int8 buffers, so the module
checkpoints as plain int8/fp32 tensors (safetensors) and reloads exactly.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

from ...graph import targets
from ...graph.forge_graph import ForgeGraph
from ...graph.ir import classify
from ...graph.metadata import get_meta, has_meta
from ...graph.packed import LoweredLayer, register_lowered
from ..base import forge_pass
from ..contract import NumericalContract, PassInfo, register_property
from ..rewrite import GraphRewrite, inject_modules
from ..select import iter_layers
from .fixed import scale_zero_point, tensor_range
from .int8_input import (
    _QUANTIZED_TENSOR_WARNING,
    FP32_BOUND,
    INPUT_SCHEMES,
    dynamic_input_codes,
    input_scheme_of,
    static_input_range,
)
from .modules import QuantizedLinear
from .records import LoweringRecord
from .state import quantized_nodes
from .woq_modules import int8_linear_bits

__all__ = ["Int8Linear", "lower_int8_transform_pass", "LowerInt8Args", "LowerInt8Info", "BACKENDS", "lowerable",
           "onednn_available", "int8_kernel_saturates"]

BACKENDS: tuple[str, ...] = ("onednn", "fbgemm")
POST_OPS: tuple[str, ...] = ("none", "gelu", "relu")


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear (x86 CPUs)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn.qlinear_pointwise, "default")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def int8_kernel_saturates(backend: str) -> bool:
    """Whether ``backend``'s int8 GEMM on this CPU saturates 16-bit pair sums (no VNNI): probed, not guessed.

    Multiplies uint8 codes 255 by int8 weights 127 (exact: 255 * 127 * 64 per output) and compares.
    """
    k, exact = 64, 255.0 * 127.0 * 64
    weight = torch.full((4, k), 127, dtype=torch.int8)
    zero = torch.zeros(4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QUANTIZED_TENSOR_WARNING)
        if backend == "fbgemm":
            qw = torch._make_per_channel_quantized_tensor(weight, torch.ones(4, dtype=torch.double), zero, 0)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            outs = [torch.ops.quantized.linear_dynamic(torch.full((m, k), 255.0), packed, False) for m in (1, 17)]
        elif backend == "onednn":
            if not onednn_available():
                return False
            packed = torch.ops.onednn.qlinear_prepack(weight, None)
            outs = [torch.ops.onednn.qlinear_pointwise.default(
                torch.full((m, k), 255, dtype=torch.uint8), 1.0, 0, packed, torch.ones(4), zero, None, 1.0, 0,
                torch.float32, "none", [], "") for m in (1, 17)]
        else:
            raise ValueError(f"unknown int8 backend {backend!r}; allowed: {list(BACKENDS)}")
    return any(bool((out - exact).abs().max() > 0.5) for out in outs)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights on a real int8 CPU kernel (see the module docstring).

    ``static_input``: quantize inputs with the stored ``input_scale``/``input_zero_point`` (uint8)
    instead of each batch's range (onednn only). ``post_op``: an activation fused into the kernel's
    epilogue (``gelu`` with ``post_op_algorithm`` ``none`` (erf) or ``tanh``, or ``relu``; onednn).
    ``reduce_range``: always quantize inputs to 7 bits; they are anyway where this CPU's kernel saturates
    (:attr:`effective_reduce_range`). ``input_scheme``: how dynamic inputs are quantized (onednn):
    ``symmetric``/``asymmetric`` as the simulated 8-bit data_in quantizer, ``torch`` (old checkpoints)
    ``quantize_per_tensor_dynamic``; see :mod:`.int8_input`.
    """

    fxforge_op = "linear"
    weight_int8: torch.Tensor  # buffers (registered in __init__)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor
    input_zero_point: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: str = "onednn",
                 reduce_range: bool = False, static_input: bool = False, post_op: str = "none",
                 post_op_algorithm: str = "", input_scheme: str = "torch") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown int8 backend {backend!r}; allowed: {list(BACKENDS)}")
        if input_scheme not in INPUT_SCHEMES or (input_scheme != "torch" and backend != "onednn"):
            raise ValueError(f"input_scheme must be one of {list(INPUT_SCHEMES)} ('torch' only on fbgemm, which "
                             f"quantizes inside its kernel), got {input_scheme!r}")
        self.input_scheme = input_scheme
        if static_input and backend != "onednn":
            raise ValueError("static (calibrated) input scales need backend 'onednn'; fbgemm is dynamic only")
        if post_op not in POST_OPS or (post_op != "none" and backend != "onednn"):
            raise ValueError(f"post_op must be one of {list(POST_OPS)} (fused by onednn only), got {post_op!r}")
        if post_op_algorithm not in ("", "none", "tanh"):
            raise ValueError(f"post_op_algorithm must be '', 'none' or 'tanh', got {post_op_algorithm!r}")
        self.post_op, self.post_op_algorithm = post_op, post_op_algorithm
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.backend, self.reduce_range, self.static_input = backend, bool(reduce_range), bool(static_input)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.register_buffer("input_scale", torch.ones(()))
        self.register_buffer("input_zero_point", torch.zeros(()))
        self._kernel: dict[str, Any] = {}  # packed weight (not a tensor attribute: never checkpointed)

    @classmethod
    def from_linear(cls, layer: nn.Linear, per_channel: bool = True, backend: str = "onednn",
                    reduce_range: bool = False, input_range: tuple[float, int] | None = None,
                    input_scheme: str | None = None) -> Int8Linear:
        """Quantize ``layer``'s weight symmetrically to int8 (narrow range [-127, 127]).

        ``input_range``: a static (scale, uint8 zero point) for the inputs; None quantizes per batch
        (``input_scheme``; None: as ``layer``'s simulated data_in quantizer on onednn, else ``torch``).
        """
        if input_scheme is None:
            onednn_dynamic = backend == "onednn" and input_range is None
            input_scheme = input_scheme_of(layer) if onednn_dynamic and isinstance(layer, QuantizedLinear) else "torch"
        masked = getattr(layer, "masked_weight", None)  # a pruned layer (passes/prune): its zeros stay zero
        w = (masked() if callable(masked) else layer.weight).detach().float()
        lo, hi = tensor_range(w, 0 if per_channel else None)
        scale, _ = scale_zero_point(lo, hi, 8, symmetric=True)
        scale = scale.expand(w.shape[0]).contiguous() if scale.dim() == 0 else scale
        new = cls(layer.in_features, layer.out_features, layer.bias is not None, backend, reduce_range,
                  static_input=input_range is not None, input_scheme=input_scheme)
        new.weight_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        new.weight_scale = scale.float()
        if layer.bias is not None:
            masked_bias = getattr(layer, "masked_bias", None)
            new.bias = (masked_bias() if callable(masked_bias) else layer.bias).detach().float().clone()
        if input_range is not None:
            new.input_scale = torch.tensor(float(input_range[0]))
            new.input_zero_point = torch.tensor(float(input_range[1]))
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

    @property
    def effective_reduce_range(self) -> bool:
        """7-bit input codes: asked for, or needed because this CPU's int8 kernel saturates 8-bit ones."""
        return self.reduce_range or int8_kernel_saturates(self.backend)

    def _pack(self) -> dict[str, Any]:
        if not self._kernel:
            zero = torch.zeros(self.out_features, dtype=torch.long)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_QUANTIZED_TENSOR_WARNING)
                if self.backend == "fbgemm":
                    qw = torch._make_per_channel_quantized_tensor(self.weight_int8, self.weight_scale.double(),
                                                                  zero, 0)
                    packed = torch.ops.quantized.linear_prepack(qw, self.bias)
                else:
                    packed = torch.ops.onednn.qlinear_prepack(self.weight_int8, None)
            reduce = self.effective_reduce_range
            x_scale, x_zero_point = float(self.input_scale), int(self.input_zero_point)
            if reduce:  # the calibrated 8-bit range [-zp * s, (255 - zp) * s] mapped onto codes 0..127
                x_scale, x_zero_point = x_scale * 255 / 127, min(127, max(0, round(x_zero_point * 127 / 255)))
            self._kernel = {"packed": packed, "zero": zero, "x_scale": x_scale, "x_zero_point": x_zero_point,
                            "reduce_range": reduce}
        return self._kernel

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        """The uint8 codes, scale and zero point the kernel multiplies for a 2-D float input ``x``.

        fbgemm quantizes inside its kernel the same way (dynamic per tensor); this is its reference.
        """
        k = self._pack()
        if self.static_input:
            scale, zero_point = k["x_scale"], k["x_zero_point"]
            qmax = 127 if k["reduce_range"] else 255
            xq = torch.clamp(torch.round(x.float() / scale) + zero_point, 0, qmax).to(torch.uint8)
            return xq, scale, zero_point
        return dynamic_input_codes(x, self.input_scheme, k["reduce_range"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self._pack()
        if self.backend == "fbgemm":
            return torch.ops.quantized.linear_dynamic(x.float(), k["packed"], k["reduce_range"])
        shape = x.shape
        xq, scale, zero_point = self.quantize_input(x.reshape(-1, shape[-1]))
        y = torch.ops.onednn.qlinear_pointwise.default(
            xq, scale, zero_point, k["packed"], self.weight_scale, k["zero"], self.bias, 1.0, 0, torch.float32,
            self.post_op, [], self.post_op_algorithm)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}, input={'static' if self.static_input else 'dynamic ' + self.input_scheme}, "
                f"post_op={self.post_op}")


targets.register_module(
    Int8Linear,
    lambda m: {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None,
               "backend": m.backend, "reduce_range": m.reduce_range, "static_input": m.static_input,
               "post_op": m.post_op, "post_op_algorithm": m.post_op_algorithm, "input_scheme": m.input_scheme},
    lambda c: Int8Linear(**c),
    name="fxforge.quantize.Int8Linear",
)
register_lowered(LoweredLayer("fxforge.quantize.Int8Linear", Int8Linear, ("weight_int8", "weight_scale", "bias"),
                              int8_linear_bits))  # its input_scale / input_zero_point are calibration, not weight


register_property("int8-lowered", lambda graph: any(True for _ in iter_layers(graph.model, Int8Linear)),
                  "an Int8Linear (real int8 kernel) is in the graph (lower_int8_transform_pass)")


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
    if x is not None and x.p["granularity"] == "per_channel":
        return "data_in is per-channel (int8 GEMMs take one input scale)"
    q = layer.data_in_quantizer
    if q is not None and q.needs_calibration and not q.calibrated:
        return "data_in is not calibrated (run calibrate_transform_pass first)"
    if layer.quant.role("data_out") is not None:
        return "data_out is quantized (the int8 kernel returns fp32)"
    if getattr(layer, "act_sparsity", 0.0) > 0:
        return "it prunes its input at run time (activation pruning from prune_transform_pass)"
    return None


@dataclass(frozen=True)
class LowerInt8Args:
    """backend: ``auto`` (onednn when available, else fbgemm), ``onednn`` or ``fbgemm``;
    reduce_range: always 7-bit activations (also used, whatever this flag, where the CPU's int8 kernel
    saturates 8-bit ones: no VNNI, see :func:`int8_kernel_saturates`); strict: fail when a quantized
    linear cannot be lowered instead of leaving it simulated;
    fuse_activations: fold a GELU/ReLU that only consumes a lowered linear into its kernel (onednn)."""

    backend: Literal["auto", "onednn", "fbgemm"] = "auto"
    reduce_range: bool = False
    strict: bool = False
    fuse_activations: bool = True


@dataclass(frozen=True)
class LowerInt8Info(PassInfo):
    """lowered: layers now on an int8 kernel; static_inputs: of those, with calibrated input scales;
    fused_activations: GELU/ReLU folded into a kernel; skipped: path -> why it stayed simulated;
    reduce_range: inputs use 7-bit codes (asked for, or this CPU's int8 kernel saturates 8-bit)."""

    lowered: int = 0
    static_inputs: int = 0
    fused_activations: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    backend: str = ""
    reduce_range: bool = False


@forge_pass("transform", LowerInt8Args, info=LowerInt8Info, requires=("quantized",), ensures=("int8-lowered",),
            contract=NumericalContract("bounded", note="int8 GEMM vs simulated quantization: error reported; onednn "
                                         "with dynamic 8-bit data_in on a non-saturating CPU: " + FP32_BOUND))
def lower_int8_transform_pass(graph: ForgeGraph, args: LowerInt8Args) -> tuple[ForgeGraph, LowerInt8Info]:
    """Swap scaled-int8 QuantizedLinear layers for Int8Linear (real int8 kernels)."""
    backend = args.backend if args.backend != "auto" else ("onednn" if onednn_available() else "fbgemm")
    if backend == "onednn" and not onednn_available():
        raise ValueError("backend 'onednn' is not available in this torch build; use 'fbgemm'")
    gm = graph.model
    skipped: dict[str, str] = {}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for name, module in gm.named_modules():
        if isinstance(module, QuantizedLinear) and name not in called:
            skipped[name] = ("wrapped by another module (a LoRA adapter from insert_lora_adapter_transform_pass): "
                             "fuse it first with fuse_lora_weights_transform_pass")
        elif isinstance(module, QuantizedLinear) and (why := lowerable(module)) is not None:
            skipped[name] = why
    if skipped and args.strict:
        raise ValueError(f"cannot lower {len(skipped)} quantized linear(s) to int8: {skipped}")
    static: dict[str, bool] = {}

    def build(name: str, module: nn.Module) -> nn.Module | None:
        if not isinstance(module, QuantizedLinear) or lowerable(module) is not None:
            return None
        w = module.quant.role("weight")
        assert w is not None
        input_range = static_input_range(module) if backend == "onednn" else None
        static[name] = input_range is not None
        return Int8Linear.from_linear(module, w.p["granularity"] == "per_channel", backend, args.reduce_range,
                                      input_range)

    done = inject_modules(gm, {"type": [QuantizedLinear]}, None, build,
                          what="scaled-int8 quantized linear (from quantize_transform_pass, 8-bit scaled_integer)")
    kernel = "onednn::qlinear_pointwise" if backend == "onednn" else "quantized::linear_dynamic"
    reduce = args.reduce_range or int8_kernel_saturates(backend)
    for node, rec in quantized_nodes(gm):
        name = str(node.target)
        if node.op == "call_module" and name in static:
            activation = "uint8 per-tensor " + ("static (calibrated)" if static[name] else "dynamic")
            if reduce:
                why = "" if args.reduce_range else " (this CPU's int8 kernel saturates 8-bit)"
                activation += ", 7-bit codes" + why
            get_meta(node).software.set(LoweringRecord(kernel=kernel, activation=activation))
            rec.quantizers = {}  # the simulated quantizers are gone; the config stays as provenance
    fused = _fuse_activations(gm, set(static)) if backend == "onednn" and args.fuse_activations else []
    return graph, LowerInt8Info(lowered=len(done), static_inputs=sum(static.values()), fused_activations=len(fused),
                                skipped=skipped, backend=backend, reduce_range=reduce)


def _activation(node: fx.Node, gm: fx.GraphModule) -> tuple[str, str] | None:
    """(post_op, algorithm) when ``node`` is a GELU/ReLU of its first input only, else None."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    op = classify(node, gm)[1]
    if op == "relu" and len(node.args) == 1 and not node.kwargs:
        return "relu", ""
    if op != "gelu":
        return None
    if node.op == "call_module":
        approximate = getattr(gm.get_submodule(str(node.target)), "approximate", "none")
    else:
        extra = {**dict(zip(("approximate",), node.args[1:])), **node.kwargs}
        if set(extra) - {"approximate"}:
            return None
        approximate = extra.get("approximate", "none")
    return ("gelu", approximate) if approximate in ("none", "tanh") else None


def _fuse_activations(gm: fx.GraphModule, lowered: set[str]) -> list[str]:
    """Fold ``act(int8_linear(x))`` into the linear's kernel when the activation is its only user."""
    fused: dict[str, str] = {}
    with GraphRewrite(gm) as rw:
        for node in list(gm.graph.nodes):
            if node.op != "call_module" or str(node.target) not in lowered or len(node.users) != 1:
                continue
            user = next(iter(node.users))
            act = _activation(user, gm)
            module = gm.get_submodule(str(node.target))
            if act is None or user.args[0] is not node or not isinstance(module, Int8Linear) \
                    or module.post_op != "none":
                continue
            module.post_op, module.post_op_algorithm = act
            rw.bypass(user, node)
            rw.touch(node)
            fused[str(node.target)] = act[0]
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) in fused and has_meta(node):
            rec = get_meta(node).software.get(LoweringRecord)
            if rec is not None:
                rec.kernel += f" + fused {fused[str(node.target)]}"
    return list(fused)
