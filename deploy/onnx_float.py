"""Write an exported inference program as ``model.onnx`` with torch.onnx's dynamo exporter (torch.export program
in, ONNX graph out), inputs and outputs named as the signature names them, then rewritten for ONNX Runtime's
speed where no result changes (onnx_rewrites.py). fxforge's own QDQ ops (dynamic int8 linears) are translated
by deploy/qdq_dynamic.py's table.

Weights are stored inside the file when they fit comfortably in one protobuf (< 1.5 GB) and beside it as
``model.onnx.data`` otherwise, in the artifact directory either way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .manifest import DeployError
from .onnx_rewrites import drop_softmax_nan_guards
from .qdq_dynamic import ONNX_TRANSLATIONS
from .signature import DeployProgram, torch_noise_ignored

__all__ = ["write_onnx", "INLINE_LIMIT"]

INLINE_LIMIT = 3 << 29  # 1.5 GB: protobuf files end at 2 GB


def write_onnx(program: DeployProgram, path: Path) -> Path:
    """Export ``program`` to the ONNX file ``path``; DeployError naming the failure (an op without an ONNX
    translation is named by torch.onnx's message)."""
    ep = program.program
    weight_bytes = sum(t.numel() * t.element_size() for t in (*ep.state_dict.values(), *ep.constants.values())
                       if isinstance(t, torch.Tensor))
    try:
        with torch.no_grad(), torch_noise_ignored():
            onnx_program = torch.onnx.export(ep, (), dynamo=True, input_names=list(program.signature.input_names),
                                             output_names=list(program.signature.output_names), verbose=False,
                                             custom_translation_table=dict(ONNX_TRANSLATIONS))
    except Exception as exc:
        raise DeployError(f"ONNX export failed ({type(exc).__name__}: {str(exc)[:800]})") from exc
    if onnx_program is None:
        raise DeployError("ONNX export returned no program")
    drop_softmax_nan_guards(onnx_program.model)
    onnx_program.save(path, external_data=weight_bytes >= INLINE_LIMIT)
    return path


def ort_failure(path: Path, inputs: dict[str, torch.Tensor]) -> str | None:
    """ONNX Runtime's error running ``path`` once on ``inputs`` (None when it runs): a symbolic dimension some
    kernel cannot handle fails here, in milliseconds, rather than in the subprocess check."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4  # the error is returned, not printed
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, {name: t.numpy() for name, t in inputs.items()})
    except Exception as exc:
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
    return None
