"""Write an exported inference program as an AOTInductor package ``model.pt2``: compiled C++ kernels and weights
that ``torch._inductor.aoti_load_package`` runs without the model's Python code (or fxforge)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch._inductor

from .manifest import DeployError
from .signature import DeployProgram, torch_noise_ignored

__all__ = ["write_aoti", "INDUCTOR_CONFIGS"]

# freezing: weights become constants of the package, so inductor prepacks the linears for oneDNN
# (mkldnn._linear_pointwise) and folds constants, instead of calling addmm on the raw weights at every run.
# Measured on the fine-tuned MiniLM (2-core EPYC, 2 threads, interleaved medians): 0.69x fp32 eager at 8x128
# and 1x128, against 0.99x without it. Outputs stay within 1e-6 relative of eager.
# aot_inductor.check_lowerbound off: the package checks its inputs' sizes against the exported ranges when run with
# AOTI_RUNTIME_CHECK_INPUTS=1 (without it, measured: tiny BERT at sequence 65 and 100, past its 64 positions,
# returned numbers silently), but the lower bound it would check is torch.export's tracing minimum 2, which would
# refuse batch 1 (checked correct by the subprocess check); deploy.json records the real minimum.
# cpp.enable_concat_linear: linears reading one input (attention's Q, K and V) become one GEMM after freezing;
# measured on the same MiniLM, each runtime alone in its process: 0.80x -> 0.78x of eager at 8x128 (2-4% faster).
INDUCTOR_CONFIGS: dict[str, object] = {"freezing": True, "aot_inductor.check_lowerbound": False,
                                       "cpp.enable_concat_linear": True}


def write_aoti(program: DeployProgram, path: Path) -> Path:
    """Compile and package ``program`` at ``path`` (tens of seconds even for small models: inductor compiles
    C++), frozen (``INDUCTOR_CONFIGS``); DeployError naming the failure."""
    try:
        with torch.no_grad(), torch_noise_ignored():
            out = torch._inductor.aoti_compile_and_package(program.program, package_path=str(path),
                                                            inductor_configs=dict(INDUCTOR_CONFIGS))
    except Exception as exc:
        raise DeployError(f"AOTInductor compile failed ({type(exc).__name__}: {str(exc)[:800]})") from exc
    if Path(out).resolve() != path.resolve() or not path.is_file():
        raise DeployError(f"AOTInductor wrote {out}, not the package {path}")
    return path
