"""``export_onnx`` / ``export_aoti``: a ForgeGraph to a checked deploy directory (artifact + ``deploy.json``).

Steps: check the output path, build the inference signature and torch.export it (deploy/signature.py), refuse
ops no runtime outside fxforge can run (``fxforge::`` kernels, other custom namespaces), write the artifact into a
staged sibling directory, check it in a fresh subprocess without fxforge (deploy/check.py) at two input shapes
against the fxforge graph's own outputs, write the manifest and move the directory into place. A failed check
still leaves the artifact and its manifest (so ``fxforge inspect`` shows what was measured) and raises. Axes
asked dynamic that stay static (the guard fixes them, torch.export specialises them, or ONNX Runtime cannot run
them) are warned once and left out of the manifest's ``dynamic_axes``. The manifest records each dynamic axis's
allowed sizes (``axis_ranges``, outputs' axes following inputs'); an ONNX file carries a range guard that makes
ONNX Runtime refuse an input outside them, naming it (deploy/onnx_ranges.py).

Quantized graphs: ONNX exports the QDQ rewrite of the graph (deploy/qdq.py) and is checked in quantization steps
against fxforge's simulated outputs; AOTInductor compiles the simulated graph itself (its fake-quant ops are
plain torch ops) and is checked in steps too (relative, as float, when only weights are quantized: no activation
quantizer has a step then).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..graph.forge_graph import ForgeGraph
from ..passes.quantize.quantizer import iter_quantizers
from .aoti import write_aoti
from .manifest import ARTIFACT_FILES, DeployCheck, DeployError, DeployManifest, write_manifest
from .onnx_float import ort_failure, write_onnx
from .onnx_ranges import guard_ranges_file
from .output_dir import StagedDir, check_output_dir
from .qdq import dedicate_dq_file, output_step, to_qdq
from .qdq_dynamic import NAMESPACE as QDQ_NAMESPACE
from .qdq_dynamic import dynamic_steps
from .qdq_int4 import int4_weights, store_int4_file
from .signature import DeployProgram, InferenceSignature, export_program, inference_signature, manifest_axes

__all__ = ["export_onnx", "export_aoti", "check_ops", "check_cases", "FLOAT_BOUND", "QUANT_STEP_BOUND",
           "RUNTIME_NAMESPACES"]

FLOAT_BOUND = 1e-4  # relative: max |artifact - graph| / max |graph|
QUANT_STEP_BOUND = 1.0  # quantized: within one quantization step of fxforge's simulated outputs
# Op namespaces an artifact may hold: ATen (and its primitives), the QDQ ops ONNX turns into Quantize/
# DequantizeLinear, and torch's control-flow operators. Python's operator.* calls on sizes have no namespace.
RUNTIME_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed", "higher_order"})


def export_onnx(mg: ForgeGraph, out_dir: str | os.PathLike[str], *, dynamic_batch: bool = True,
                dynamic_seq: bool = True, check: bool = True, source: str = "") -> DeployManifest:
    """Export ``mg`` to ``out_dir/model.onnx`` (float, or QDQ for a quantized graph) and check it with ONNX
    Runtime; returns the manifest written beside it. DeployError for a bad path, an op no runtime can run,
    a layer QDQ cannot express, or a failed check (the artifact is still written then)."""
    return _export("onnx", mg, out_dir, dynamic_batch, dynamic_seq, check, source)


def export_aoti(mg: ForgeGraph, out_dir: str | os.PathLike[str], *, dynamic_batch: bool = True,
                dynamic_seq: bool = True, check: bool = True, source: str = "") -> DeployManifest:
    """Compile ``mg`` to the AOTInductor package ``out_dir/model.pt2`` and check it with
    ``torch._inductor.aoti_load_package``; same contract as :func:`export_onnx`."""
    return _export("aoti", mg, out_dir, dynamic_batch, dynamic_seq, check, source)


def _export(fmt: str, mg: ForgeGraph, out_dir: str | os.PathLike[str], dynamic_batch: bool, dynamic_seq: bool,
            check: bool, source: str) -> DeployManifest:
    check_output_dir(out_dir)  # before any work: a bad path fails in milliseconds
    reference = inference_signature(mg)
    quantizers = iter_quantizers(mg.model)
    quantization, exported_graph = "float", mg
    bound_kind, bound, step = "relative", FLOAT_BOUND, 1.0
    int4: dict[str, bool] = {}
    dynamic = any(q.params.get("dynamic", False) and q.enabled and not q.is_param for _, q in quantizers)
    if quantizers and fmt == "onnx":
        qdq = to_qdq(mg)
        int4 = int4_weights(qdq.graph.model)  # <= 4-bit weights: INT4 / UINT4 initializers at opset 21
        exported_graph, quantization = qdq.graph, qdq.description
        bound_kind, bound, step = "quant_steps", QUANT_STEP_BOUND, qdq.output_step or 0.0
    elif quantizers:
        quantization = f"simulated ({len(quantizers)} quantizers, fake-quant as torch ops)"
        try:
            bound_kind, bound, step = "quant_steps", QUANT_STEP_BOUND, float(output_step(mg))
        except DeployError:  # no static activation quantizer: dynamic ones (steps measured below), or weights only
            if dynamic:
                bound_kind, bound, step = "quant_steps", QUANT_STEP_BOUND, 0.0
            else:
                quantization += "; weights only, checked as float"
    signature = reference if exported_graph is mg else inference_signature(exported_graph)
    if (signature.input_names, signature.output_names) != (reference.input_names, reference.output_names):
        raise DeployError(f"the QDQ graph's inputs/outputs {signature.input_names}/{signature.output_names} differ "
                          f"from the graph's {reference.input_names}/{reference.output_names}")
    check_ops(signature.module)
    staged = StagedDir(out_dir)
    try:
        artifact = staged.path / ARTIFACT_FILES[fmt]
        program = _write(fmt, signature, artifact, dynamic_batch, dynamic_seq, qdq=bound_kind == "quant_steps",
                         int4=int4)
        labels, ranges = manifest_axes(program)
        result: DeployCheck | None = None
        if check:
            from .check import check_artifact

            with dynamic_steps(reference.module) as taken:  # steps batch-scaled quantizers take on the cases
                cases = check_cases(program, reference)
            if dynamic and bound_kind == "quant_steps":
                step = max([step, *taken])
            result = check_artifact(staged.path, fmt, cases, bound, bound_kind, step, ranges=ranges, labels=labels)
        manifest = DeployManifest(
            format=fmt, artifact=ARTIFACT_FILES[fmt],
            artifact_bytes=sum(p.stat().st_size for p in staged.path.iterdir() if p.is_file()),
            inputs=signature.input_names, outputs=signature.output_names, dynamic_axes=labels,
            quantization=quantization, source=source, check=result, axis_ranges=ranges)
        write_manifest(staged.path, manifest)
        out = staged.commit()
    except BaseException:
        staged.discard()
        raise
    raise_if_failed(fmt, out, result)
    return manifest


def raise_if_failed(fmt: str, out: Path, result: DeployCheck | None) -> None:
    """DeployError stating the worst measured error and its bound when the subprocess check failed (the artifact
    and its manifest are already written, so the user can inspect them)."""
    if result is not None and not result.passed:
        worst = max(result.shapes, key=lambda s: s.error / s.bound if s.bound else s.error)
        raise DeployError(f"{fmt} artifact written to {out} but its check failed: error {worst.error:.3g} "
                          f"({worst.bound_kind}) > bound {worst.bound:g} at shapes {worst.shapes}"
                          + ("" if not result.fxforge_importable else "; fxforge was importable in the check"))


def _write(fmt: str, signature: InferenceSignature, artifact: Path, dynamic_batch: bool,
           dynamic_seq: bool, qdq: bool = False, int4: dict[str, bool] | None = None) -> DeployProgram:
    """Export and write the artifact. ONNX: the file is run once in ONNX Runtime on the example inputs; when
    ORT cannot run it with the asked dynamic axes (its DFT kernel and an rfft over a symbolic length, measured
    on the zoo's gpt-afno), the sequence axis, then the batch axis, is made static and the reason warned. A QDQ
    file gets a Q/DQ pair per reader (``dedicate_dq_file``): the exporter shares one pair between query, key and
    value, and ORT then leaves those MatMuls in float."""
    attempts = [(dynamic_batch, dynamic_seq)]
    if fmt == "onnx":
        attempts += [a for a in ((dynamic_batch, False), (False, False)) if a not in attempts]
    notes: list[str] = []
    for i, (batch, seq) in enumerate(attempts):
        program = export_program(signature, batch, seq)
        # fxforge_qdq ops (dynamic int8 linears) exist in QDQ graphs only, which only go to ONNX: translated there
        check_ops(program.program.graph_module, signature.module,
                  frozenset({QDQ_NAMESPACE}) if fmt == "onnx" else frozenset())
        if fmt == "aoti":
            write_aoti(program, artifact)
            break
        write_onnx(program, artifact)
        if qdq:
            dedicate_dq_file(artifact)
        guard_ranges_file(artifact, _input_ranges(program), program.dynamic_axes)
        store_int4_file(artifact, int4 or {})
        failure = ort_failure(artifact, signature.example_inputs) if program.dynamic_axes else None
        if failure is None:
            break
        if i + 1 == len(attempts):
            raise DeployError(f"ONNX Runtime cannot run the exported model on its example inputs: {failure}")
        notes.append(f"ONNX Runtime could not run the model with dynamic axes {program.dynamic_axes} ({failure}); "
                     f"retried with {'batch only dynamic' if attempts[i + 1][0] else 'static shapes'}")
    static = [*notes, *program.static]
    if static:  # asked for but not dynamic: said once here, and absent from the manifest's dynamic_axes
        warnings.warn("deploy: " + "; ".join(static), stacklevel=4)
    return program


def _input_ranges(program: DeployProgram) -> dict[str, dict[int, tuple[int, int | None]]]:
    """The range of each dynamic input axis, by input."""
    ranges: dict[str, dict[int, tuple[int, int | None]]] = {}
    for (name, axis), r in program.axis_ranges.items():
        if axis in program.dynamic_axes.get(name, {}):
            ranges.setdefault(name, {})[axis] = r
    return ranges


def _namespace(target: Any) -> str | None:
    """The op namespace of an fx call target (``fxforge`` for ``torch.ops.fxforge.x``); None for Python calls."""
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target.namespace)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher_order"
    return None


def check_ops(gm: fx.GraphModule, origin: fx.GraphModule | None = None, allowed: frozenset[str] = frozenset()) -> None:
    """DeployError naming the first op outside :data:`RUNTIME_NAMESPACES` (and ``allowed``: namespaces the format
    translates, e.g. ONNX's QDQ ops) and its node. ``origin`` is the fxforge graph ``gm`` was exported from: the
    node named is then the fxforge node (module call) the op came from."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        ns = _namespace(node.target)
        if ns is None or ns in RUNTIME_NAMESPACES or ns in allowed:
            continue
        where = f"node {node.name!r}" if origin is None else _origin(node, origin)
        why = "an fxforge kernel, which exists only inside fxforge" if ns == "fxforge" else \
            f"an op of the {ns!r} namespace, which ONNX Runtime and AOTInductor packages cannot run"
        fix = " (a lowered layer: export the simulated graph from before lowering)" if ns == "fxforge" else ""
        raise DeployError(f"cannot deploy: op {ns}::{_op_name(node.target)} at {where} is {why}{fix}")


def _op_name(target: Any) -> str:
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(name).split(".")[0]


def _origin(node: fx.Node, origin: fx.GraphModule) -> str:
    """The fxforge node an exported node came from: the innermost module call on its stack that is a node."""
    calls = {str(n.target): n.name for n in origin.graph.nodes if n.op == "call_module"}
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        key = path.replace("L['self'].", "").replace("L__self___", "")
        if key in calls:
            return f"node {calls[key]!r} (module {key})"
    names = {n.name for n in origin.graph.nodes}
    return f"node {node.name!r}" if node.name in names else f"exported node {node.name!r}"


def _case_inputs(sig: InferenceSignature, sizes: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Inputs shaped like the examples with ``sizes`` (``batch``/``seq``) on their dynamic axes and fresh values
    of the examples' kind: ids drawn from the example's range, masks of ones with the last row half padded,
    floats with the example's mean and spread."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sig.input_names:
        ex = sig.example_inputs[name]
        shape = list(ex.shape)
        if "batch" in sizes and ex.dim() >= 1:
            shape[0] = sizes["batch"]
        if "seq" in sizes and ex.dim() == 2 and not ex.is_floating_point():
            shape[1] = sizes["seq"]
        if ex.is_floating_point():
            std = float(ex.float().std()) if ex.numel() > 1 else 1.0
            t = (torch.randn(shape, generator=gen) * std + float(ex.float().mean())).to(ex.dtype)
        elif "mask" in name and ex.dim() == 2:
            t = torch.ones(shape, dtype=ex.dtype)
            t[-1, max(shape[1] // 2, 1):] = 0
        else:
            lo, hi = int(ex.min()), int(ex.max())
            t = torch.randint(lo, hi + 1, shape, generator=gen).to(ex.dtype)
        out[name] = t
    return out


def check_cases(program: DeployProgram, reference: InferenceSignature) -> list[Any]:
    """Two check cases with the fxforge graph's outputs as expected: dynamic batch -> 1 then 3 (batch 1 is
    where torch.export's 0/1 specialisation could hide a difference), dynamic sequence -> the example's length
    then a shorter (or longer) one, inside the proven ranges; static axes keep the example's sizes."""
    from .check import CheckCase

    sig = program.signature
    batch = {r for (n, a), r in program.axis_ranges.items() if program.dynamic_axes.get(n, {}).get(a) == "batch"}
    seq = {r for (n, a), r in program.axis_ranges.items() if program.dynamic_axes.get(n, {}).get(a) == "seq"}
    sizes: list[dict[str, int]] = [{}, {}]
    if batch:
        lo, hi = max(r[0] for r in batch), min((r[1] for r in batch if r[1] is not None), default=None)
        sizes[0]["batch"], sizes[1]["batch"] = _clamp(1, lo, hi), _clamp(3, lo, hi)
    if seq:
        lo, hi = max(r[0] for r in seq), min((r[1] for r in seq if r[1] is not None), default=None)
        ex = next(int(sig.example_inputs[n].shape[a]) for (n, a), label in
                  ((k, program.dynamic_axes[k[0]][k[1]]) for k in program.axis_ranges) if label == "seq")
        other = _clamp(ex - 5 if ex - 5 >= max(lo, 2) else ex + 5, lo, hi)
        sizes[0]["seq"], sizes[1]["seq"] = ex, other
    cases = []
    for i, sz in enumerate(sizes):
        inputs = _case_inputs(sig, sz, seed=i + 1)
        cases.append(CheckCase(inputs=inputs, expected=reference(inputs)))
    return cases


def _clamp(v: int, lo: int, hi: int | None) -> int:
    return max(lo, v if hi is None else min(v, hi))
