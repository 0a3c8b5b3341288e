"""The registry of number formats: each format's parameters (types, defaults, checks) and quantizer.

A config names a format (``"name": "integer"``) and gives its parameters per role with MASE's flat
keys ``<role>_<param>`` (``data_in_width``, ``weight_frac_width``...). This module validates one
role's parameters and applies the format to a tensor; the quantizer functions themselves live in
``fixed.py``, ``minifloat.py`` and ``block.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .block import block_fp_quantize, mxfp_element, mxfp_quantize, mxint_quantize
from .fixed import broadcast_along, fixed_point_quantize
from .minifloat import SPECIALS, MinifloatFormat, minifloat_quantize

__all__ = ["AUTO", "Param", "FormatDef", "FORMATS", "ROLES", "QuantizeConfigError", "check_role_params",
           "get_format", "is_auto_fixed"]

ROLES: tuple[str, ...] = ("data_in", "weight", "bias", "data_out")
AUTO = "auto"  # a fixed-point frac_width chosen from the tensor's range (weights) or the calibrated one
_REQUIRED = object()


class QuantizeConfigError(ValueError):
    """A quantization config is invalid; the message names the key and the allowed values."""


@dataclass(frozen=True)
class Param:
    """One format parameter: JSON type, default (``_REQUIRED`` if none) and allowed values."""

    name: str
    kind: type
    default: Any = _REQUIRED
    choices: tuple[Any, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    doc: str = ""
    special: tuple[str, ...] = ()  # words accepted besides values of ``kind`` (``"auto"``)

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def check(self, value: Any, where: str) -> Any:
        ok = isinstance(value, self.kind) and not (self.kind is int and isinstance(value, bool))
        if self.default is None and value is None:
            return None
        if isinstance(value, str) and value in self.special:
            return value
        if not ok:
            words = f" or one of {list(self.special)}" if self.special else ""
            raise QuantizeConfigError(f"{where} must be of type {self.kind.__name__}{words}, got {value!r}")
        if self.choices and value not in self.choices:
            raise QuantizeConfigError(f"{where} = {value!r} is not allowed; allowed: {list(self.choices)}")
        if self.minimum is not None and value < self.minimum or self.maximum is not None and value > self.maximum:
            raise QuantizeConfigError(f"{where} = {value} is outside [{self.minimum}, {self.maximum}]")
        return value


Quantizer = Callable[[torch.Tensor, Mapping[str, Any], "QuantContext"], torch.Tensor]


@dataclass(frozen=True)
class QuantContext:
    """What a quantizer needs besides the tensor: axes and the scale state of scaled formats."""

    block_axis: int = -1
    channel_axis: int = -1
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None


@dataclass(frozen=True)
class FormatDef:
    """A number format: parameters, cross-parameter check, quantizer and storage cost in bits."""

    name: str
    params: tuple[Param, ...]
    quantize: Quantizer
    bits: Callable[[Mapping[str, Any]], float]
    validate: Callable[[Mapping[str, Any]], None] = lambda p: None
    doc: str = ""
    scaled: bool = False  # needs a scale (from the tensor itself or from calibration)

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def _minifloat(p: Mapping[str, Any]) -> MinifloatFormat:
    return MinifloatFormat(p["exponent_width"], p["width"] - 1 - p["exponent_width"], p["exponent_bias"],
                           p["special"], p["saturate"])


def _check_minifloat(p: Mapping[str, Any]) -> None:
    if p["width"] - 1 - p["exponent_width"] < 0:
        raise ValueError(f"width {p['width']} leaves no room for 1 sign and {p['exponent_width']} exponent bits")
    _minifloat(p)


def is_auto_fixed(fmt: str, p: Mapping[str, Any]) -> bool:
    """Is this fixed point whose fraction width comes from the range (``frac_width: "auto"``)?"""
    return fmt == "integer" and p.get("frac_width") == AUTO


def _check_fixed(p: Mapping[str, Any]) -> None:
    if p["frac_width"] == AUTO:
        return
    if p["frac_width"] > p["width"]:
        raise ValueError(f"frac_width {p['frac_width']} > width {p['width']}: a width-bit fixed point has at most "
                         "width fraction bits (range [-2^(w-1), 2^(w-1) - 1] / 2^frac); lower frac_width")


def _check_block_fp(p: Mapping[str, Any]) -> None:
    bias = 2 ** (p["exponent_width"] - 1) - 1 if p["exponent_bias"] is None else p["exponent_bias"]
    lo, hi = -bias, 2 ** p["exponent_width"] - 1 - bias
    if lo > 127 or hi < -126:
        raise ValueError(f"exponent range [{lo}, {hi}] (exponent_width {p['exponent_width']}, bias {bias}) lies "
                         "outside float32's [-126, 127], in which results are returned; pick another exponent_bias")


def _check_mxfp(p: Mapping[str, Any]) -> None:
    """(width, exponent_width) must name an OCP MX element format (mxfp_element says which do)."""
    mxfp_element(p["width"], p["exponent_width"])


def _fixed_quantize(x: torch.Tensor, p: Mapping[str, Any], ctx: QuantContext) -> torch.Tensor:
    """MASE fixed point; with ``frac_width: "auto"`` the context's scale is ``2^-frac_width`` (per channel or not)."""
    if p["frac_width"] != AUTO:
        return fixed_point_quantize(x, p["width"], p["frac_width"])
    if ctx.scale is None:
        raise RuntimeError("frac_width 'auto' needs a range: calibrate activations (calibrate_transform_pass)")
    frac = -torch.log2(ctx.scale)
    return fixed_point_quantize(x, p["width"], broadcast_along(frac, x.dim(), ctx.channel_axis))


def _scaled_quantize(x: torch.Tensor, p: Mapping[str, Any], ctx: QuantContext) -> torch.Tensor:
    from .fixed import scaled_integer_quantize

    if ctx.scale is None or ctx.zero_point is None:
        raise RuntimeError("scaled_integer needs a scale: calibrate (calibrate_analysis_pass) or set dynamic")
    axis = ctx.channel_axis if p["granularity"] == "per_channel" else None
    return scaled_integer_quantize(x, ctx.scale, ctx.zero_point, p["width"], p["symmetric"], axis)


_WIDTH = Param("width", int, minimum=2, maximum=32, doc="total bits")

FORMATS: dict[str, FormatDef] = {
    f.name: f
    for f in (
        FormatDef(
            "integer",
            (_WIDTH, Param("frac_width", int, minimum=-64, maximum=64, special=(AUTO,),
                           doc="fraction bits, or 'auto': the most that still cover the range (weights: per "
                               "output row, from the weights; activations: per tensor, from calibration)")),
            _fixed_quantize,
            lambda p: float(p["width"]),
            validate=_check_fixed,
            doc="MASE fixed point: round(x * 2^frac) / 2^frac in the signed width-bit range",
        ),
        FormatDef(
            "scaled_integer",
            (
                Param("width", int, minimum=2, maximum=16),
                Param("symmetric", bool, True),
                Param("granularity", str, "per_tensor", choices=("per_tensor", "per_channel")),
                Param("dynamic", bool, False, doc="activations: scale from each batch instead of calibration"),
            ),
            _scaled_quantize,
            lambda p: float(p["width"]),
            doc="affine integers; weight scales come from the weight, activation scales from calibration",
            scaled=True,
        ),
        FormatDef(
            "minifloat",
            (
                Param("width", int, minimum=3, maximum=32),
                Param("exponent_width", int, minimum=1, maximum=8),
                Param("exponent_bias", int, None, minimum=-256, maximum=256),
                Param("special", str, "ieee", choices=SPECIALS),
                Param("saturate", bool, True),
            ),
            lambda x, p, ctx: minifloat_quantize(x, _minifloat(p)),
            lambda p: float(p["width"]),
            validate=_check_minifloat,
            doc="sign + exponent + mantissa (FP8 E4M3: width 8, exponent_width 4, special 'fn')",
        ),
        FormatDef(
            "block_fp",
            (
                Param("width", int, minimum=2, maximum=24),
                Param("exponent_width", int, 8, minimum=1, maximum=8),
                Param("exponent_bias", int, None, minimum=-256, maximum=256),
                Param("block_size", int, 32, minimum=1, maximum=4096),
            ),
            lambda x, p, ctx: block_fp_quantize(x, p["width"], p["exponent_width"], p["exponent_bias"],
                                                p["block_size"], ctx.block_axis),
            lambda p: p["width"] + p["exponent_width"] / p["block_size"],
            validate=_check_block_fp,
            doc="shared exponent per block, width-bit fixed-point elements",
        ),
        FormatDef(
            "mxint",
            (Param("width", int, minimum=2, maximum=24), Param("block_size", int, 32, minimum=1, maximum=4096)),
            lambda x, p, ctx: mxint_quantize(x, p["width"], p["block_size"], ctx.block_axis),
            lambda p: p["width"] + 8 / p["block_size"],
            doc="OCP MXINT (MXINT8: width 8): E8M0 scale per block of 32, int elements with 6 fraction bits",
        ),
        FormatDef(
            "mxfp",
            (
                Param("width", int, choices=(4, 6, 8)),
                Param("exponent_width", int, choices=(2, 3, 4, 5)),
                Param("block_size", int, 32, minimum=1, maximum=4096),
            ),
            lambda x, p, ctx: mxfp_quantize(x, p["width"], p["exponent_width"], p["block_size"], ctx.block_axis),
            lambda p: p["width"] + 8 / p["block_size"],
            validate=_check_mxfp,
            doc="OCP MXFP (MXFP8 E4M3: width 8, exponent_width 4): E8M0 scale per block, minifloat elements",
        ),
    )
}


# MASE's format names: aliases where fxforge's format means the same, refusals (with the reason) where not.
MASE_FORMAT_ALIASES: dict[str, str] = {"minifloat_ieee": "minifloat"}
MASE_FORMAT_REFUSED: dict[str, str] = {
    "minifloat_denorm": "use 'minifloat' (special 'ieee' keeps denormals; see its 'special' choices)",
    "log": "fxforge has no logarithmic format", "block_log": "fxforge has no logarithmic format",
    "block_minifloat": "use 'mxfp' (shared E8M0 scale per block, minifloat elements)",
    "binary": "fxforge has no binary format", "ternary": "fxforge has no ternary format",
}


def get_format(name: Any) -> FormatDef:
    """The format called ``name`` (MASE names accepted where they mean the same); QuantizeConfigError otherwise."""
    if isinstance(name, str) and name in MASE_FORMAT_REFUSED:
        raise QuantizeConfigError(f"MASE format {name!r} is not supported: {MASE_FORMAT_REFUSED[name]}; "
                                  f"allowed: {sorted(FORMATS)}")
    name = MASE_FORMAT_ALIASES.get(name, name) if isinstance(name, str) else name
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise QuantizeConfigError(f"unknown quantization format {name!r}; allowed: {sorted(FORMATS)}")
    return fmt


def check_role_params(fmt: FormatDef, given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate one role's parameters (``given`` without the role prefix) and fill in defaults."""
    out: dict[str, Any] = {}
    missing = [p.name for p in fmt.params if p.required and p.name not in given]
    if missing:
        raise QuantizeConfigError(f"{where}: format {fmt.name!r} needs {sorted(missing)} "
                                  f"(parameters: {list(fmt.param_names)})")
    for p in fmt.params:
        out[p.name] = p.check(given[p.name], f"{where}_{p.name}") if p.name in given else p.default
    try:
        fmt.validate(out)
    except ValueError as exc:
        raise QuantizeConfigError(f"{where}: {exc}") from None
    return out
