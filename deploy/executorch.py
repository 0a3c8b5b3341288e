"""``export_executorch``: a ForgeGraph to an ExecuTorch program ``model.pte`` (XNNPACK delegate), checked outside
fxforge with ``executorch.runtime``.

Pipeline: the inference signature exported by torch.export (deploy/signature.py), then
``executorch.exir.to_edge_transform_and_lower`` with the XNNPACK partitioner, ``to_executorch`` and the program's
bytes written as ``model.pte``; the check runs it at two input shapes in a fresh process without fxforge, as for
ONNX and AOTInductor (deploy/check.py).

Two things differ from the other formats:

* ExecuTorch plans every activation buffer ahead of time for each dynamic axis's upper bound, so dynamic axes
  need a finite one. Sequence takes the range the graph's shape guard proves (refused when it proves none);
  batch, which no guard bounds, is capped at ``max_batch`` (default 8). Every batch 1..max_batch runs at every
  proven length; the runtime refuses an input with more elements than the planned ``max_batch x longest`` ones
  ("Attempted to resize a bounded tensor"; a larger batch of shorter sequences happens to fit). deploy.json
  records batch's range as ``1..max_batch`` and the sequence's as the guard's.
* executorch 1.5.1's edge IR validator calls ``len()`` on the list outputs of ``split_with_sizes_copy`` (the
  q/k/v split), which guards the symbolic batch to the example's value: memory is then planned for the example's
  batch (2 for the zoo GPT) and the program refuses 3 x 64 tokens. It is switched off
  (``_check_ir_validity=False``); the subprocess check at batch 3 and tests/deploy at max_batch x 64 show batch
  stays dynamic.

Quantized graphs are refused naming a quantized layer: fxforge does not map its quantizers to XNNPACK's int8
kernels yet (a simulated fake-quant graph would run float kernels and be mistaken for an int8 artifact).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..graph.forge_graph import ForgeGraph
from ..passes.quantize.quantizer import iter_quantizers
from .export import FLOAT_BOUND, check_cases, check_ops, raise_if_failed
from .manifest import ARTIFACT_FILES, DeployCheck, DeployError, DeployManifest, write_manifest
from .output_dir import StagedDir, check_output_dir
from .signature import (
    DeployProgram,
    InferenceSignature,
    export_program,
    inference_signature,
    manifest_axes,
    torch_noise_ignored,
)

__all__ = ["export_executorch", "write_pte", "DEFAULT_MAX_BATCH"]

FORMAT = "pte"
DEFAULT_MAX_BATCH = 8
# importlib.resources' legacy functions, deprecated since Python 3.11 in favour of files().
_LEGACY_RESOURCES = r"(read_text|read_binary|open_text|open_binary|is_resource|contents|path) is deprecated"


def export_executorch(mg: ForgeGraph, out_dir: str | os.PathLike[str], *, dynamic_batch: bool = True,
                      dynamic_seq: bool = True, check: bool = True, source: str = "",
                      max_batch: int = DEFAULT_MAX_BATCH) -> DeployManifest:
    """Lower ``mg`` to ``out_dir/model.pte`` (XNNPACK) and check it with ``executorch.runtime``; dynamic batch
    runs 1..``max_batch``. Returns the manifest written beside it. DeployError for a bad path, a quantized graph,
    an op no runtime can run, a dynamic axis without an upper bound, or a failed check (the artifact is still
    written then)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise DeployError(f"max_batch must be an integer >= 1 (the largest batch the .pte accepts), got {max_batch!r}")
    check_output_dir(out_dir)  # before any work: a bad path fails in milliseconds
    _refuse_quantized(mg)
    reference = inference_signature(mg)
    check_ops(reference.module)
    program = export_program(_batch_capped(reference, max_batch), dynamic_batch, dynamic_seq)
    check_ops(program.program.graph_module, reference.module)
    unbounded = [f"{name} axis {axis} ({program.dynamic_axes[name][axis]})"
                 for (name, axis), (_, hi) in program.axis_ranges.items() if hi is None]
    if unbounded:
        raise DeployError(f"cannot lower to ExecuTorch: {', '.join(unbounded)} has no upper bound (ExecuTorch plans "
                          "memory for each dynamic axis's largest size); export with that axis static "
                          "(--no-dynamic-seq / dynamic_seq=False)")
    staged = StagedDir(out_dir)
    try:
        artifact = staged.path / ARTIFACT_FILES[FORMAT]
        write_pte(program, artifact)
        labels, ranges = manifest_axes(program)  # batch's range is 1..max_batch: the format's cap
        result: DeployCheck | None = None
        if check:
            from .check import check_artifact

            result = check_artifact(staged.path, FORMAT, check_cases(program, reference), FLOAT_BOUND, "relative",
                                    ranges=ranges, labels=labels)
        manifest = DeployManifest(
            format=FORMAT, artifact=ARTIFACT_FILES[FORMAT], artifact_bytes=artifact.stat().st_size,
            inputs=reference.input_names, outputs=reference.output_names, dynamic_axes=labels,
            quantization="float", source=source, check=result, axis_ranges=ranges)
        write_manifest(staged.path, manifest)
        out = staged.commit()
    except BaseException:
        staged.discard()
        raise
    raise_if_failed(FORMAT, out, result)
    return manifest


def _refuse_quantized(mg: ForgeGraph) -> None:
    """DeployError naming the first quantized layer: no quantized graph is lowered to ExecuTorch yet."""
    quantizers = iter_quantizers(mg.model)
    if quantizers:
        name = quantizers[0][0]
        layer = name.rsplit(".", 1)[0] if "." in name else name
        raise DeployError(f"cannot lower to ExecuTorch: layer {layer!r} is quantized ({len(quantizers)} quantizers "
                          "in the graph) and XNNPACK int8 via fxforge is not supported yet; export the float graph "
                          "as pte, or this graph with --format onnx (QDQ int8) or aoti")


def _batch_capped(sig: InferenceSignature, max_batch: int) -> InferenceSignature:
    """``sig`` with every input's axis 0 (batch) bounded by ``max_batch`` on top of the guard's proven range."""
    ranges = dict(sig.ranges)
    for name in sig.input_names:
        if sig.example_inputs[name].dim() == 0:
            continue
        lo, hi = ranges.get((name, 0), (1, None))
        if max(lo, 1) > max_batch:
            raise DeployError(f"max_batch {max_batch} is below the smallest batch {lo} the graph accepts for "
                              f"input {name!r}")
        ranges[(name, 0)] = (lo, max_batch if hi is None else min(hi, max_batch))
    return dataclasses.replace(sig, ranges=ranges)


@contextmanager
def _executorch_noise_ignored() -> Iterator[None]:
    """Ignore the deprecation warnings executorch 1.5.1 raises in its own code, which no caller can act on
    (errors under ``-W error``): it reads its resource files (``edge.yaml``, the flatbuffer schemas) with
    importlib.resources' legacy ``read_text`` / ``read_binary`` (which call the legacy ``open_*`` in turn), plus
    torch's own exporter noise."""
    with warnings.catch_warnings(), torch_noise_ignored():
        warnings.filterwarnings("ignore", _LEGACY_RESOURCES, DeprecationWarning, r"executorch\.")
        warnings.filterwarnings("ignore", _LEGACY_RESOURCES, DeprecationWarning, r"importlib\.resources\._legacy")
        yield


def write_pte(program: DeployProgram, path: Path) -> Path:
    """Lower ``program`` to XNNPACK and write the ExecuTorch program to ``path`` (about a minute for a small
    GPT: most of it in the edge passes); DeployError naming the failure."""
    try:
        with torch.no_grad(), _executorch_noise_ignored():
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import (  # type: ignore[import-untyped]
                XnnpackPartitioner,
            )
            from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower  # type: ignore[import-untyped]

            edge = to_edge_transform_and_lower(program.program, partitioner=[XnnpackPartitioner()],
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
            buffer = edge.to_executorch().buffer
    except Exception as exc:
        raise DeployError(f"ExecuTorch lowering failed ({type(exc).__name__}: {str(exc)[:800]})") from exc
    path.write_bytes(buffer)
    return path
