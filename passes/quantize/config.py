"""MASE's quantization config, parsed into an immutable, fully validated :class:`QuantizeConfig`.

::

    {"by": "type",                                   # or "name" / "regex"
     "default": {"config": {"name": None}},          # None: leave unmatched ops alone
     "linear": {"config": {"name": "integer",
                           "data_in_width": 8, "data_in_frac_width": 4,
                           "weight_width": 8, "weight_frac_width": 4,
                           "bias_width": 8, "bias_frac_width": 4}}}

* ``by: type`` keys are canonical ops (:data:`QUANTIZABLE_OPS`, or ``"fft"`` for every FFT op);
  embeddings (:data:`OPT_IN_OPS`) are quantized only by a rule that names them, never by ``default``;
  ``by: name`` keys are module paths / node names (a dotted suffix also matches, as everywhere in
  fxforge's selector language); ``by: regex`` keys are full-match regexes. With name/regex the first
  matching key (in dict order) wins.
* An op config holds ``name`` (a format of :data:`FORMATS`, or None), optional ``bypass`` and the
  format's parameters per role as ``<role>_<param>``; roles are ``data_in`` (inputs; the first
  operand of a matmul), ``weight`` (module weight; the second operand of a matmul, or a parameter on
  its left: ``W @ x``), ``bias`` and ``data_out`` (the output). A role is quantized when any of its keys
  is given. Roles an op does not have are ignored, so one default config can serve every op. An operand
  that is a parameter (or a view, slice or split of one) takes its scale from its own values on every
  call, whatever its role; only activations take theirs from calibration.

Parsing never mutates the caller's dict; every error names the key and lists the allowed values.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .formats import FORMATS, ROLES, QuantizeConfigError, check_role_params, get_format

__all__ = [
    "BY",
    "FFT_OPS",
    "QUANTIZABLE_OPS",
    "OpQuantConfig",
    "QuantizeConfig",
    "RoleSpec",
    "QuantizeConfigError",
]

BY: tuple[str, ...] = ("type", "name", "regex")
FFT_OPS: tuple[str, ...] = (
    "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2",
    "fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn",
)
QUANTIZABLE_OPS: tuple[str, ...] = (
    "linear", "conv1d", "conv2d", "matmul", "bmm", "einsum", "add", "sub", "mul", "relu", "gelu", "softmax",
    "layer_norm", "embedding", *FFT_OPS,
)
# Quantized only when a rule names them (by type, name or regex), never by ``default``: a config written
# before embeddings were quantizable keeps its meaning (MASE's default never touched the embedding tables).
OPT_IN_OPS: tuple[str, ...] = ("embedding",)
TYPE_KEYS: tuple[str, ...] = (*QUANTIZABLE_OPS, "fft")
_OP_CONFIG_KEYS = ("name", "bypass")


@dataclass(frozen=True)
class RoleSpec:
    """The validated format parameters of one role (e.g. ``data_in``)."""

    format: str
    params: tuple[tuple[str, Any], ...]

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def bits(self) -> float:
        return get_format(self.format).bits(self.p)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, **self.p}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoleSpec:
        data = dict(data)
        fmt = get_format(data.pop("format"))
        return cls(fmt.name, tuple(sorted(check_role_params(fmt, data, "role").items())))


@dataclass(frozen=True)
class OpQuantConfig:
    """One op's validated config: the format and the spec of each quantized role."""

    format: str
    roles: tuple[tuple[str, RoleSpec], ...]

    def role(self, name: str) -> RoleSpec | None:
        return dict(self.roles).get(name)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.roles)

    def to_json(self) -> dict[str, Any]:
        """MASE's flat form: ``{"name": ..., "data_in_width": ...}`` with defaults filled in."""
        out: dict[str, Any] = {"name": self.format}
        for role, spec in self.roles:
            out.update({f"{role}_{k}": v for k, v in spec.params})
        return out

    @classmethod
    def parse(cls, cfg: Any, where: str) -> OpQuantConfig | None:
        """Validate a MASE op config; None when it quantizes nothing (``name`` None or ``bypass``)."""
        if not isinstance(cfg, Mapping):
            raise QuantizeConfigError(f"{where} must be a dict with a 'name' key, got {type(cfg).__name__}")
        if "name" not in cfg:
            raise QuantizeConfigError(f"{where} has no 'name'; use one of {sorted(FORMATS)} or None")
        name = cfg["name"]
        if name is None:
            extra = sorted(set(cfg) - set(_OP_CONFIG_KEYS))
            if extra:
                raise QuantizeConfigError(f"{where}: name is None (no quantization) but keys {extra} are given")
            return None
        fmt = get_format(name)
        allowed = [*_OP_CONFIG_KEYS, *(f"{r}_{p}" for r in ROLES for p in fmt.param_names)]
        unknown = sorted(set(cfg) - set(allowed))
        if unknown:
            raise QuantizeConfigError(f"{where}: unknown key(s) {unknown} for format {name!r}; allowed: {allowed}")
        bypass = cfg.get("bypass", False)
        if not isinstance(bypass, bool):
            raise QuantizeConfigError(f"{where}.bypass must be a bool, got {bypass!r}")
        roles = []
        for role in ROLES:
            given = {p: cfg[f"{role}_{p}"] for p in fmt.param_names if f"{role}_{p}" in cfg}
            if given:
                params = check_role_params(fmt, given, f"{where}.{role}")
                roles.append((role, RoleSpec(fmt.name, tuple(sorted(params.items())))))
        if not roles:
            raise QuantizeConfigError(f"{where}: format {name!r} is given for no role; give e.g. "
                                      f"'data_in_{fmt.param_names[0]}' (roles: {list(ROLES)})")
        return None if bypass else cls(fmt.name, tuple(roles))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpQuantConfig:
        out = cls.parse(data, "stored config")
        if out is None:
            raise QuantizeConfigError("stored quantization config quantizes nothing")
        return out


@dataclass(frozen=True)
class QuantizeConfig:
    """The parsed pass arguments of ``quantize_transform_pass``; build it with :meth:`from_dict`."""

    by: str = "type"
    default: OpQuantConfig | None = None
    rules: tuple[tuple[str, OpQuantConfig | None], ...] = ()

    @classmethod
    def from_dict(cls, pass_args: Any) -> QuantizeConfig:
        """Validate a MASE config dict (never mutated; a deep copy is read)."""
        if isinstance(pass_args, QuantizeConfig):
            return pass_args
        if not isinstance(pass_args, Mapping):
            raise QuantizeConfigError(f"quantization config must be a dict, got {type(pass_args).__name__}")
        args = copy.deepcopy(dict(pass_args))
        by = args.pop("by", "type")
        by = "regex" if by == "regex_name" else by  # MASE's module pass spells it regex_name
        if by not in BY:
            raise QuantizeConfigError(f"'by' must be one of {list(BY)}, got {by!r}")
        default = cls._entry(args.pop("default", {"config": {"name": None}}), "default")
        rules: list[tuple[str, OpQuantConfig | None]] = []
        for key, entry in args.items():
            if not isinstance(key, str):
                raise QuantizeConfigError(f"config keys must be strings, got {key!r}")
            if by == "type" and key not in TYPE_KEYS:
                raise QuantizeConfigError(f"unknown op type {key!r} for by='type'; allowed: "
                                          f"{['by', 'default', *TYPE_KEYS]}")
            if by == "regex":
                try:
                    re.compile(key)
                except re.error as exc:
                    raise QuantizeConfigError(f"regex key {key!r} is invalid: {exc}") from None
            rules.append((key, cls._entry(entry, key)))
        return cls(by=by, default=default, rules=tuple(rules))

    @classmethod
    def from_pass_args(cls, pass_args: Any) -> QuantizeConfig:
        """The pass decorator's hook: parse the free-form MASE config (errors become PassArgsError)."""
        return cls.from_dict(pass_args)

    @staticmethod
    def _entry(entry: Any, key: str) -> OpQuantConfig | None:
        if not isinstance(entry, Mapping) or set(entry) != {"config"}:
            got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise QuantizeConfigError(f"config[{key!r}] must be {{'config': {{...}}}} (only the key 'config'), "
                                      f"got {got}")
        return OpQuantConfig.parse(entry["config"], f"config[{key!r}]")

    def rule_for(self, name: str, op: str, module: Any = None) -> tuple[str | None, OpQuantConfig | None]:
        """(matching rule key or None for the default, config) for a node, MASE lookup semantics."""
        from ..select import matches_by

        for key, cfg in self.rules:
            if self.by == "type":
                hit = key == op or (key == "fft" and op in FFT_OPS)
            else:  # by name: a module path (or dotted suffix) or the fx node name MASE users know
                hit = matches_by(self.by, key, name, module, op) or \
                    (self.by == "name" and key == name.replace(".", "_"))
            if hit:
                return key, cfg
        return None, None if op in OPT_IN_OPS else self.default

    def to_json(self) -> dict[str, Any]:
        """The config in MASE's form with defaults filled in."""
        out: dict[str, Any] = {"by": self.by,
                               "default": {"config": self.default.to_json() if self.default else {"name": None}}}
        for key, cfg in self.rules:
            out[key] = {"config": cfg.to_json() if cfg else {"name": None}}
        return out
