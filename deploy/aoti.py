"""Write an exported inference program as an AOTInductor package ``model.pt2``: compiled C++ kernels and weights
that ``torch._inductor.aoti_load_package`` runs without the model's Python code (or fxforge)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch._inductor

from .manifest import DeployError
from .signature import DeployProgram, torch_noise_ignored

__all__ = ["write_aoti"]


def write_aoti(program: DeployProgram, path: Path) -> Path:
    """Compile and package ``program`` at ``path`` (tens of seconds even for small models: inductor compiles
    C++); DeployError naming the failure."""
    try:
        with torch.no_grad(), torch_noise_ignored():
            out = torch._inductor.aoti_compile_and_package(program.program, package_path=str(path))
    except Exception as exc:
        raise DeployError(f"AOTInductor compile failed ({type(exc).__name__}: {str(exc)[:800]})") from exc
    if Path(out).resolve() != path.resolve() or not path.is_file():
        raise DeployError(f"AOTInductor wrote {out}, not the package {path}")
    return path
