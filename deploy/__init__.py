"""Deploy a ForgeGraph outside fxforge: ONNX (float or QDQ) for ONNX Runtime, AOTInductor ``.pt2`` packages,
ExecuTorch ``.pte`` programs (XNNPACK).

Each export writes a directory holding the artifact and ``deploy.json`` (deploy/manifest.py), after checking
the artifact in a fresh subprocess where fxforge is not importable.
"""

from .executorch import export_executorch
from .export import export_aoti, export_onnx
from .manifest import (
    ARTIFACT_FILES,
    FORMATS,
    MANIFEST_NAME,
    DeployCheck,
    DeployError,
    DeployManifest,
    ShapeCheck,
    is_deploy_dir,
    read_manifest,
)

__all__ = ["ARTIFACT_FILES", "FORMATS", "MANIFEST_NAME", "DeployCheck", "DeployError", "DeployManifest",
           "ShapeCheck", "export_aoti", "export_executorch", "export_onnx", "is_deploy_dir", "read_manifest"]
