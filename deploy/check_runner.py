"""Run a deploy artifact outside fxforge and print how far its outputs are from the expected ones (one JSON).

Started by deploy/check.py as ``python -I check_runner.py --format onnx|aoti|pte --artifact FILE --cases DIR`` in a
fresh process. It first makes ``fxforge`` unimportable (the checkout is installed in editable mode, so a plain
interpreter would import it), so the artifact is proven to run without fxforge's code. A case whose input axis is
outside the ranges deploy.json records is refused before it runs (:func:`check_ranges`, which any consumer can
call on a deploy.json document), and AOTInductor packages are loaded with their own input checks on
(``AOTI_RUNTIME_CHECK_INPUTS=1``). This file is a standalone script: stdlib, numpy, torch, onnxruntime,
executorch and safetensors only; never fxforge, no relative imports.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import sys
from pathlib import Path
from typing import Any

BLOCKED = "fxforge"
CHECKOUT = Path(__file__).resolve().parent.parent  # the fxforge checkout (the repository root is the package)


class _RefuseFxforge(importlib.abc.MetaPathFinder):
    """Refuses ``fxforge`` and ``fxforge.*`` before any other finder (the editable install's included)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"{fullname} is blocked in the deploy check", name=fullname)
        return None


def _exposes_checkout(entry: str) -> bool:
    """Whether a sys.path entry could import the checkout's code: the checkout itself or a folder above it
    (an installed ``fxforge`` elsewhere is refused by the finder; its folder also holds torch)."""
    try:
        where = Path(entry or ".").resolve()
    except OSError:
        return True
    return where == CHECKOUT or where in CHECKOUT.parents


def block_fxforge() -> None:
    """Make ``import fxforge`` fail in this process (call before importing anything else)."""
    sys.meta_path.insert(0, _RefuseFxforge())
    sys.path[:] = [entry for entry in sys.path if not _exposes_checkout(entry)]
    for name in [n for n in sys.modules if n == BLOCKED or n.startswith(BLOCKED + ".")]:
        del sys.modules[name]


def fxforge_importable() -> bool:
    """Whether ``import fxforge`` works here (it must not after block_fxforge)."""
    try:
        __import__(BLOCKED)
    except ImportError:
        return False
    return True


def check_ranges(feeds: dict[str, Any], manifest: dict[str, Any]) -> None:
    """ValueError naming the input, axis, size and range when a feed's dynamic axis is outside the sizes
    ``manifest`` (a deploy.json document, or the check's cases.json) records in ``axis_ranges``; a runtime would
    otherwise fail deep in the graph or compute outside what was checked. Manifests without ranges pass."""
    labels, ranges = manifest.get("dynamic_axes", {}), manifest.get("axis_ranges", {})
    for name, axes in ranges.items():
        if name not in feeds:
            continue
        shape = list(feeds[name].shape)
        for axis, r in axes.items():
            size, lo, hi = shape[int(axis)], int(r["min"]), r["max"]
            if size < lo or (hi is not None and size > int(hi)):
                label = labels.get(name, {}).get(axis, f"dim{axis}")
                raise ValueError(f"input {name!r} axis {axis} ({label}) has size {size}, outside the artifact's "
                                 f"range {lo}..{'' if hi is None else hi} (deploy.json's axis_ranges)")


def _load_cases(cases_dir: Path) -> tuple[list[str], list[str], list[tuple[dict, dict]], dict[str, Any]]:
    from safetensors.torch import load_file

    spec = json.loads((cases_dir / "cases.json").read_text())
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    cases = [(load_file(str(cases_dir / f"case{i}_inputs.safetensors")),
              load_file(str(cases_dir / f"case{i}_expected.safetensors"))) for i in range(int(spec["cases"]))]
    return inputs, outputs, cases, {k: spec.get(k, {}) for k in ("dynamic_axes", "axis_ranges")}


def _onnx_runner(artifact: Path, input_names: list[str], output_names: list[str]) -> tuple[str, Any]:
    """An ONNX Runtime session on the CPU; outputs matched to the expected ones by name."""
    import onnxruntime as ort  # type: ignore[import-untyped]
    import torch

    session = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
    have = [o.name for o in session.get_outputs()]
    wanted = [name for name in output_names if name in have]

    def run(feeds: dict) -> dict:
        results = session.run(wanted, {name: feeds[name].numpy() for name in input_names})
        return {name: torch.from_numpy(value) for name, value in zip(wanted, results, strict=True)}

    return f"onnxruntime {ort.__version__}", run


def _aoti_runner(artifact: Path, input_names: list[str], output_names: list[str]) -> tuple[str, Any]:
    """A loaded AOTInductor package, called with the inputs positionally in the manifest's order (as
    deploy/signature.py exports it); its flat outputs matched to the expected ones by position."""
    import torch
    import torch.utils._pytree as pytree

    # The package checks every input's sizes against its exported ranges only when this is set (see deploy.json's
    # axis_ranges): without it, a sequence past the bound runs silently on out-of-range positions.
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    model = torch._inductor.aoti_load_package(str(artifact))

    def run(feeds: dict) -> dict:
        with torch.no_grad():
            result = model(*[feeds[name] for name in input_names])
        flat = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        return dict(zip(output_names, flat, strict=False))

    return f"torch.aoti {torch.__version__}", run


def _pte_runner(artifact: Path, input_names: list[str], output_names: list[str]) -> tuple[str, Any]:
    """An ExecuTorch program's ``forward`` loaded with ``executorch.runtime`` (the wheel's XNNPACK delegate),
    called with the inputs positionally in the manifest's order; its outputs matched by position."""
    from importlib.metadata import version

    from executorch.runtime import Runtime  # type: ignore[import-untyped]

    method = Runtime.get().load_program(artifact).load_method("forward")

    def run(feeds: dict) -> dict:
        result = method.execute([feeds[name] for name in input_names])
        return dict(zip(output_names, [t.clone() for t in result], strict=False))

    return f"executorch {version('executorch')} (XNNPACK)", run


def _compare(name: str, got: Any, expected: Any) -> dict[str, Any]:
    """Max |got - expected| over the positions where both are finite, max |expected|, shapes, and how many
    positions disagree about being finite (or hold different infinities / one NaN)."""
    import torch

    entry: dict[str, Any] = {"name": name, "expected_shape": list(expected.shape), "shape": None,
                             "max_abs_diff": 0.0, "max_abs_expected": 0.0, "nonfinite_mismatches": 0}
    exp = expected.detach().to(torch.float64)
    finite_exp = exp[torch.isfinite(exp)]
    entry["max_abs_expected"] = float(finite_exp.abs().max()) if finite_exp.numel() else 0.0
    if got is None:
        return entry
    entry["shape"] = list(got.shape)
    if list(got.shape) != list(expected.shape):
        return entry
    val = got.detach().to(torch.float64)
    both = torch.isfinite(val) & torch.isfinite(exp)
    if both.any():
        entry["max_abs_diff"] = float((val - exp).abs()[both].max())
    same_special = (val == exp) | (torch.isnan(val) & torch.isnan(exp))
    entry["nonfinite_mismatches"] = int((~both & ~same_special).sum())
    return entry


def main(argv: list[str] | None = None) -> int:
    block_fxforge()
    out = os.fdopen(os.dup(1), "w")  # the JSON goes to the real stdout; anything libraries print goes to stderr
    os.dup2(2, 1)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--format", choices=("onnx", "aoti", "pte"), required=True)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--cases", type=Path, required=True)
    args = parser.parse_args(argv)
    doc: dict[str, Any] = {"fxforge_importable": fxforge_importable()}
    try:
        input_names, output_names, cases, ranges = _load_cases(args.cases)
        make = {"onnx": _onnx_runner, "aoti": _aoti_runner, "pte": _pte_runner}[args.format]
        doc["runtime"], run = make(args.artifact, input_names, output_names)
        doc["cases"] = []
        for feeds, expected in cases:
            check_ranges(feeds, ranges)
            got = run(feeds)
            doc["cases"].append([_compare(name, got.get(name), expected[name]) for name in output_names])
    except Exception as exc:  # reported to the parent, which raises it as a DeployError
        doc["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out.write(json.dumps(doc, allow_nan=False) + "\n")
    out.flush()
    return 1 if "error" in doc else 0


if __name__ == "__main__":
    sys.exit(main())
