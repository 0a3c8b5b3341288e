"""What a deploy artifact directory holds and what its check found: ``deploy.json`` beside the artifact.

A deploy directory (``fxforge deploy ... -o OUT``) holds exactly one artifact (``model.onnx``, ``model.pt2`` or
``model.pte``) and ``deploy.json``, this manifest: the format, the flat input and output names, the dynamic axes
of inputs and outputs with each one's allowed sizes (version 2: ``axis_ranges``; version 1 manifests, without
them, still read), how the graph was quantized, the artifact's size and the result of the subprocess check
(graph outputs against the runtime's, at two input shapes). The CLI, ``fxforge inspect`` and the HTML report read
it back; a manifest is a file, so reading it treats every value as hostile (types, sizes and names are checked,
unknown keys refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..graph.atomic import dumps_json, loads_json
from ..graph.targets import CheckpointError

__all__ = ["FORMATS", "ARTIFACT_FILES", "MANIFEST_NAME", "MANIFEST_VERSION", "DeployError", "AxisRange", "ShapeCheck",
           "DeployCheck", "DeployManifest", "read_manifest", "write_manifest", "is_deploy_dir"]

FORMATS: tuple[str, ...] = ("onnx", "aoti", "pte")
ARTIFACT_FILES: dict[str, str] = {"onnx": "model.onnx", "aoti": "model.pt2", "pte": "model.pte"}
MANIFEST_NAME = "deploy.json"
MANIFEST_VERSION = 2  # 2: axis_ranges (1 had none)
READ_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 1 << 20
MAX_SIZE = 1 << 50  # the largest axis size (or byte count) a manifest may state
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")
_FOLLOWS = re.compile(r"^([A-Za-z_][A-Za-z0-9_.:-]{0,127})\[([0-9]{1,2})\]$")


class DeployError(ValueError):
    """An export or check that cannot be done as asked; the message names the layer, op or path and why."""


@dataclass(frozen=True)
class AxisRange:
    """The sizes a dynamic axis accepts, ``min..max`` (``max`` None: no upper bound). An output's axis names the
    input axis it follows (``"input_ids[0]"``: logits' batch); an input's ``follows`` is empty."""

    min: int
    max: int | None
    follows: str = ""

    def __str__(self) -> str:
        return f"{self.min}..{'' if self.max is None else self.max}"

    def accepts(self, size: int) -> bool:
        return self.min <= size and (self.max is None or size <= self.max)


@dataclass(frozen=True)
class ShapeCheck:
    """One input shape's comparison of the runtime's outputs with the fxforge graph's.

    ``bound_kind`` is ``"relative"`` (float artifacts: max |runtime - graph| / max |graph| per output) or
    ``"quant_steps"`` (QDQ artifacts: max |runtime - graph| in units of the output's quantization step)."""

    shapes: dict[str, list[int]]
    error: float
    bound: float
    bound_kind: str
    passed: bool


@dataclass(frozen=True)
class DeployCheck:
    """The subprocess check: which runtime ran the artifact, whether fxforge was importable there (it never is
    when the check passed), the per-shape results and how long the check took."""

    runtime: str
    fxforge_importable: bool
    shapes: tuple[ShapeCheck, ...]
    passed: bool
    seconds: float


@dataclass(frozen=True)
class DeployManifest:
    """``deploy.json``: see the module docstring. ``quantization`` is ``"float"`` or a short description such as
    ``"qdq int8 (12 layers)"``; ``source`` names the checkpoint or zoo model it came from. ``dynamic_axes`` labels
    the dynamic axes of inputs and outputs (``{"input_ids": {1: "seq"}}``) and ``axis_ranges`` holds, for the same
    axes, the sizes the artifact accepts (the shape guard's range; a .pte's batch capped at its max_batch)."""

    format: str
    artifact: str
    artifact_bytes: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)
    quantization: str = "float"
    source: str = ""
    check: DeployCheck | None = None
    version: int = MANIFEST_VERSION
    axis_ranges: dict[str, dict[int, AxisRange]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.check is not None and self.check.passed

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "version": self.version, "format": self.format, "artifact": self.artifact,
            "artifact_bytes": self.artifact_bytes, "inputs": list(self.inputs), "outputs": list(self.outputs),
            "dynamic_axes": {name: {str(axis): label for axis, label in axes.items()}
                             for name, axes in self.dynamic_axes.items()},
            "quantization": self.quantization, "source": self.source, "check": None,
        }
        if self.version >= 2:
            doc["axis_ranges"] = {name: {str(axis): _range_json(r) for axis, r in axes.items()}
                                  for name, axes in self.axis_ranges.items()}
        if self.check is not None:
            c = self.check
            doc["check"] = {"runtime": c.runtime, "fxforge_importable": c.fxforge_importable, "passed": c.passed,
                            "seconds": c.seconds,
                            "shapes": [{"shapes": s.shapes, "error": s.error, "bound": s.bound,
                                        "bound_kind": s.bound_kind, "passed": s.passed} for s in c.shapes]}
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str = MANIFEST_NAME) -> DeployManifest:
        """Parse a manifest read from a file; DeployError naming the key on anything unexpected."""
        keys = {"version", "format", "artifact", "artifact_bytes", "inputs", "outputs", "dynamic_axes",
                "quantization", "source", "check"}
        version = _int(_obj(doc, where, None).get("version"), f"{where}: version")
        if version not in READ_VERSIONS:
            raise DeployError(f"{where}: version {version} is not supported (this fxforge reads {list(READ_VERSIONS)})")
        d = _obj(doc, where, keys | ({"axis_ranges"} if version >= 2 else set()))
        fmt = _str(d["format"], f"{where}: format")
        if fmt not in FORMATS:
            raise DeployError(f"{where}: format {fmt!r} is not one of {list(FORMATS)}")
        artifact = _str(d["artifact"], f"{where}: artifact")
        if artifact != ARTIFACT_FILES[fmt]:
            raise DeployError(f"{where}: artifact {artifact!r} must be {ARTIFACT_FILES[fmt]!r} for format {fmt}")
        axes_doc = _obj(d["dynamic_axes"], f"{where}: dynamic_axes", None)
        axes: dict[str, dict[int, str]] = {}
        for name, per in axes_doc.items():
            entry = _obj(per, f"{where}: dynamic_axes.{_name(name, where)}", None)
            axes[name] = {}
            for key, label in entry.items():
                if not key.isdigit() or len(key) > 2:
                    raise DeployError(f"{where}: dynamic_axes.{name} key {key!r} is not an axis number")
                axes[name][int(key)] = _name(label, f"{where}: dynamic_axes.{name}.{key}")
        inputs, outputs = _names(d["inputs"], f"{where}: inputs"), _names(d["outputs"], f"{where}: outputs")
        ranges: dict[str, dict[int, AxisRange]] = {}
        if version >= 2:
            unknown = sorted(set(axes) - set(inputs) - set(outputs))
            if unknown:
                raise DeployError(f"{where}: dynamic_axes names {unknown}, neither an input nor an output")
            ranges = _ranges(d["axis_ranges"], axes, inputs, f"{where}: axis_ranges")
        return cls(format=fmt, artifact=artifact,
                   artifact_bytes=_int(d["artifact_bytes"], f"{where}: artifact_bytes"),
                   inputs=inputs, outputs=outputs,
                   dynamic_axes=axes, quantization=_str(d["quantization"], f"{where}: quantization"),
                   source=_str(d["source"], f"{where}: source"),
                   check=None if d["check"] is None else _check(d["check"], f"{where}: check"), version=version,
                   axis_ranges=ranges)


def _range_json(r: AxisRange) -> dict[str, Any]:
    doc: dict[str, Any] = {"min": r.min, "max": r.max}
    if r.follows:
        doc["follows"] = r.follows
    return doc


def _ranges(doc: Any, axes: dict[str, dict[int, str]], inputs: tuple[str, ...], where: str
            ) -> dict[str, dict[int, AxisRange]]:
    """``axis_ranges``: only dynamic axes, ``min <= max`` (or max null), integers below MAX_SIZE; an output's
    ``follows`` names a dynamic input axis, an input has none."""
    out: dict[str, dict[int, AxisRange]] = {}
    for name, per in _obj(doc, where, None).items():
        entry = _obj(per, f"{where}.{_name(name, where)}", None)
        out[name] = {}
        for key, rdoc in entry.items():
            at = f"{where}.{name}.{key}"
            if not (isinstance(key, str) and key.isdigit() and len(key) <= 2 and int(key) in axes.get(name, {})):
                raise DeployError(f"{at}: {name} axis {key!r} is not a dynamic axis in dynamic_axes")
            r = _obj(rdoc, at, {"min", "max", "follows"} if isinstance(rdoc, dict) and "follows" in rdoc
                     else {"min", "max"})
            lo = _int(r["min"], f"{at}.min")
            hi = None if r["max"] is None else _int(r["max"], f"{at}.max")
            if hi is not None and hi < lo:
                raise DeployError(f"{at}: max {hi} is below its min {lo}")
            follows = ""
            if "follows" in r:
                if name in inputs:
                    raise DeployError(f"{at}: follows is for an output's axis only ({name} is an input)")
                follows = r["follows"]
                m = _FOLLOWS.match(follows) if isinstance(follows, str) else None
                if m is None or m.group(1) not in inputs or int(m.group(2)) not in axes.get(m.group(1), {}):
                    raise DeployError(f"{at}.follows: {str(follows)[:80]!r} is not a dynamic input axis "
                                      "(input[axis])")
            out[name][int(key)] = AxisRange(lo, hi, follows)
    return out


def _check(doc: Any, where: str) -> DeployCheck:
    d = _obj(doc, where, {"runtime", "fxforge_importable", "passed", "seconds", "shapes"})
    shapes = d["shapes"]
    if not isinstance(shapes, list) or len(shapes) > 16:
        raise DeployError(f"{where}.shapes must be a list of at most 16 shape checks")
    return DeployCheck(runtime=_str(d["runtime"], f"{where}.runtime"),
                       fxforge_importable=_bool(d["fxforge_importable"], f"{where}.fxforge_importable"),
                       shapes=tuple(_shape(s, f"{where}.shapes[{i}]") for i, s in enumerate(shapes)),
                       passed=_bool(d["passed"], f"{where}.passed"), seconds=_float(d["seconds"], f"{where}.seconds"))


def _shape(doc: Any, where: str) -> ShapeCheck:
    d = _obj(doc, where, {"shapes", "error", "bound", "bound_kind", "passed"})
    shapes = _obj(d["shapes"], f"{where}.shapes", None)
    dims: dict[str, list[int]] = {}
    for name, dims_doc in shapes.items():
        if not isinstance(dims_doc, list) or len(dims_doc) > 8:
            raise DeployError(f"{where}.shapes.{_name(name, where)} must be a list of at most 8 sizes")
        dims[_name(name, where)] = [_int(v, f"{where}.shapes.{name}") for v in dims_doc]
    kind = _str(d["bound_kind"], f"{where}.bound_kind")
    if kind not in ("relative", "quant_steps"):
        raise DeployError(f"{where}.bound_kind {kind!r} is not 'relative' or 'quant_steps'")
    return ShapeCheck(shapes=dims, error=_float(d["error"], f"{where}.error"),
                      bound=_float(d["bound"], f"{where}.bound"), bound_kind=kind,
                      passed=_bool(d["passed"], f"{where}.passed"))


def _obj(doc: Any, where: str, keys: set[str] | None) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise DeployError(f"{where} must be a JSON object, got {type(doc).__name__}")
    if keys is not None and set(doc) != keys:
        missing, unknown = sorted(keys - set(doc)), sorted(set(doc) - keys)
        raise DeployError(f"{where}: missing keys {missing}, unknown keys {unknown}")
    if keys is None and len(doc) > 64:
        raise DeployError(f"{where}: {len(doc)} entries, at most 64 allowed")
    return doc


def _str(v: Any, where: str, limit: int = 512) -> str:
    if not isinstance(v, str) or len(v) > limit or any(ord(ch) < 32 for ch in v):
        raise DeployError(f"{where} must be a printable string of at most {limit} characters")
    return v


def _name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not _NAME.match(v):
        raise DeployError(f"{where}: {v!r} is not a valid tensor or axis name")
    return v


def _names(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or len(v) > 64:
        raise DeployError(f"{where} must be a list of at most 64 names")
    return tuple(_name(x, where) for x in v)


def _int(v: Any, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < MAX_SIZE:
        raise DeployError(f"{where} must be a non-negative integer")
    return v


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1e300:
        raise DeployError(f"{where} must be a non-negative finite number")
    return float(v)


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise DeployError(f"{where} must be true or false")
    return v


def is_deploy_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a deploy manifest (only such a directory may be replaced)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def read_manifest(path: str | Path) -> DeployManifest:
    """The manifest of the deploy directory ``path`` (checked as hostile input)."""
    file = Path(path) / MANIFEST_NAME
    if file.is_symlink():
        raise DeployError(f"{file} is a symbolic link: a deploy manifest must be a regular file in its directory")
    if not file.is_file():
        raise DeployError(f"{path} is not a deploy directory: it has no {MANIFEST_NAME}")
    if file.stat().st_size > MAX_MANIFEST_BYTES:
        raise DeployError(f"{file}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = loads_json(file.read_bytes(), str(file), MAX_MANIFEST_BYTES)
    except (ValueError, CheckpointError) as exc:
        raise DeployError(str(exc)) from None
    return DeployManifest.from_json(doc, str(file))


def write_manifest(path: str | Path, manifest: DeployManifest) -> Path:
    """Write ``deploy.json`` into the deploy directory ``path``."""
    file = Path(path) / MANIFEST_NAME
    file.write_bytes(dumps_json(manifest.to_json(), MANIFEST_NAME))
    return file
