"""The runtimes bench_deploy_minilm compares: ONNX Runtime sessions of fxforge's artifacts and of ORT's own
quantizers, AOTInductor packages, and the fxforge int8 graphs those artifacts come from.

Every artifact of a fxforge graph is made by ``fxforge.deploy`` (``export_onnx``: float, or QDQ for a quantized
graph; ``export_aoti``), exactly as ``fxforge deploy`` makes it; ORT's quantizers run on the float ONNX file.
onnxruntime is imported by name (importlib) so type checking does not need its stubs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..graph.forge_graph import ForgeGraph
from ..search.task import logits_of, with_labels

__all__ = ["Runner", "int8_config", "fxforge_int8", "weights_as_float", "export_fp32_onnx", "export_qdq_onnx",
           "export_aoti_package", "aoti_runner", "ort_session", "ort_quantize", "artifact_bytes", "eager_runner"]

Runner = Callable[..., torch.Tensor]  # keyword inputs (input_ids, attention_mask) -> logits


def int8_config(dynamic: bool = False) -> dict[str, Any]:
    """fxforge's int8 linears: per-channel symmetric int8 weights, per-tensor asymmetric 8-bit activations with
    calibrated (static) scales, what ORT's ``quantize_static`` QDQ per-channel does; ``dynamic``: the activation
    scale from each batch instead (exported as DynamicQuantizeLinear, like ORT's ``quantize_dynamic``). Per-tensor
    weights (ORT's dynamic default) were tried for the dynamic graph: 1.3 pt less accurate on 1,000 reviews and
    not faster in the benchmark's timing (fxforge/ORT 1.078 paired, per-channel ~1.05)."""
    return {"by": "type", "default": {"config": {"name": None}},
            "linear": {"config": {"name": "scaled_integer", "weight_width": 8, "weight_symmetric": True,
                                  "weight_granularity": "per_channel", "data_in_width": 8,
                                  "data_in_symmetric": False, "data_in_granularity": "per_tensor",
                                  "data_in_dynamic": dynamic}}}


def fxforge_int8(graph: ForgeGraph, calib: list[dict[str, Any]], dynamic: bool = False) -> ForgeGraph:
    """A copy of ``graph`` with every Linear in int8 (``int8_config``): static scales calibrated (min-max) on
    ``calib``, or ``dynamic`` ones (nothing to calibrate)."""
    from ..passes.quantize import quantize_transform_pass
    from ..passes.quantize.calibrate import calibrate_transform_pass

    quantized, _ = quantize_transform_pass(graph.copy(), int8_config(dynamic))
    if not dynamic:
        quantized, _ = calibrate_transform_pass(quantized, {"data": calib, "method": "minmax"})
    return quantized.eval()


def weights_as_float(graph: ForgeGraph) -> ForgeGraph:
    """A copy of ``graph`` whose weight-only quantized Linear and Embedding layers are plain float layers holding
    the values their quantizers compute (what the graph multiplies by), so int8 can re-quantize a searched
    point's own trained weights; a layer quantizing its activations (data_in/data_out) is refused by name."""
    import torch.nn as nn

    from ..passes.quantize.modules import QuantizedEmbedding, QuantizedLinear

    out = graph.copy()
    for name, layer in list(out.model.named_modules()):
        if not isinstance(layer, QuantizedLinear | QuantizedEmbedding):
            continue
        acting = sorted(set(layer.quantizers()) & {"data_in", "data_out"})
        if acting:
            raise ValueError(f"{name}: quantizes {acting}, not only its weights; its float twin would compute "
                             "something else")
        with torch.no_grad():
            weight = layer._q("weight", layer.weight).detach().clone()
            bias = layer._q("bias", layer.bias) if isinstance(layer, QuantizedLinear) else None
            plain: nn.Linear | nn.Embedding
            if isinstance(layer, QuantizedLinear):
                plain = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None)
                if bias is not None:
                    plain.bias = nn.Parameter(bias.detach().clone())
            else:
                plain = nn.Embedding(layer.num_embeddings, layer.embedding_dim, padding_idx=layer.padding_idx)
            plain.weight = nn.Parameter(weight)
        parent, _, leaf = name.rpartition(".")
        setattr(out.model.get_submodule(parent) if parent else out.model, leaf, plain.train(layer.training))
    out.model.recompile()
    return out


def export_fp32_onnx(graph: ForgeGraph, out: Path) -> tuple[Path, str]:
    """The float ONNX artifact of ``graph`` (``fxforge.deploy.export_onnx``, unchecked: the benchmark measures
    accuracy itself) and how it was made."""
    from ..deploy import export_onnx

    manifest = export_onnx(graph, out, check=False)
    return out / manifest.artifact, f"fxforge.deploy.export_onnx ({manifest.quantization})"


def export_qdq_onnx(graph: ForgeGraph, out: Path) -> tuple[Path | None, str]:
    """fxforge's QDQ artifact of a quantized ``graph`` (``export_onnx`` rewrites it through deploy/qdq.py's
    ``to_qdq``), or (None, the refusal): only fxforge can say what its quantized layers mean."""
    from ..deploy import DeployError, export_onnx

    try:
        manifest = export_onnx(graph, out, check=False)
    except DeployError as exc:
        return None, f"refused: {str(exc)[:400]}"
    return out / manifest.artifact, manifest.quantization


def export_aoti_package(graph: ForgeGraph, out: Path) -> tuple[Path, tuple[str, ...]]:
    """The AOTInductor package of ``graph`` (``fxforge.deploy.export_aoti``) and its positional input names."""
    from ..deploy import export_aoti

    manifest = export_aoti(graph, out, check=False)
    return out / manifest.artifact, manifest.inputs


def aoti_runner(path: Path, names: tuple[str, ...]) -> Runner:
    """The package loaded with ``torch._inductor.aoti_load_package`` as a keyword runner (inputs in ``names``
    order, first output: the logits)."""
    loaded = torch._inductor.aoti_load_package(str(path))

    def run(**kw: torch.Tensor) -> torch.Tensor:
        out = loaded(*(kw[n] for n in names))
        return out[0] if isinstance(out, list | tuple) else out

    return run


def ort_session(path: Path) -> Runner:
    """An ONNX Runtime CPU session (deploy/ort_options.py: graph optimisation ALL but the slow SkipLayerNorm
    fusion, torch's thread count) as a keyword runner."""
    from ..deploy.ort_options import session_kwargs

    ort = importlib.import_module("onnxruntime")
    session = ort.InferenceSession(str(path), **session_kwargs(torch.get_num_threads()))
    names = [i.name for i in session.get_inputs()]
    outs = [o.name for o in session.get_outputs()]
    out = "logits" if "logits" in outs else outs[0]

    def run(**kw: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run([out], {k: kw[k].numpy() for k in names})[0])

    return run


def ort_quantize(fp32: Path, out: Path, how: str, calib: Iterable[Mapping[str, torch.Tensor]] = ()) -> Path:
    """ORT's own quantizers on the fp32 export: ``dynamic`` (QInt8 weights, every op ORT quantizes),
    ``dynamic-matmul`` (MatMul/Gemm only) or ``static`` (QDQ, per-channel, MatMul/Gemm, min-max on ``calib``)."""
    q = importlib.import_module("onnxruntime.quantization")
    if how == "dynamic":
        q.quantize_dynamic(str(fp32), str(out), weight_type=q.QuantType.QInt8)
    elif how == "dynamic-matmul":
        q.quantize_dynamic(str(fp32), str(out), weight_type=q.QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])
    elif how == "static":
        feeds = [{k: v.numpy() for k, v in batch.items() if k != "labels"} for batch in calib]

        class Reader(q.CalibrationDataReader):  # type: ignore[name-defined]
            def __init__(self) -> None:
                self.it = iter(feeds)

            def get_next(self) -> dict[str, Any] | None:
                return next(self.it, None)

        q.quantize_static(str(fp32), str(out), Reader(), quant_format=q.QuantFormat.QDQ, per_channel=True,
                          op_types_to_quantize=["MatMul", "Gemm"], activation_type=q.QuantType.QUInt8,
                          weight_type=q.QuantType.QInt8, calibrate_method=q.CalibrationMethod.MinMax)
    else:
        raise ValueError(f"ort_quantize: how must be dynamic, dynamic-matmul or static, got {how!r}")
    return out


def artifact_bytes(path: Path) -> int:
    """Bytes of an artifact file plus its external-data siblings (``<name>.data``), if any."""
    extra = path.with_name(path.name + ".data")
    return path.stat().st_size + (extra.stat().st_size if extra.is_file() else 0)


def eager_runner(model: torch.nn.Module) -> Runner:
    """An eager module (a captured graph or a torch.ao copy of it) as a keyword runner."""
    model.eval()
    takes_labels = "labels" in with_labels(model, {}, torch.zeros(1))  # looked up once, not inside the timing

    def run(**kw: torch.Tensor) -> torch.Tensor:
        if takes_labels:
            kw = {**kw, "labels": torch.zeros(kw["input_ids"].shape[0], dtype=torch.long)}
        return logits_of(model(**kw))

    return run
