"""MixedPrecisionSpace: per-layer (or per-op-type) number formats and widths for the quantize pass.

Candidate formats come from the quantization pass's own table (fixed point ``integer`` with
``width``/``frac_width`` as in MASE's tutorial, ``scaled_integer``, ``minifloat``, ``mxint``, ...). A
parameter given as a list is searched, a scalar is fixed; roles are ``data_in``, ``weight``, ``bias``.
Parameters that constrain each other are sampled conditionally: ``frac_width`` is drawn only from the
values the sampled ``width`` admits, under a name that says so (``linear:integer:weight_frac_width|width=4``),
so a per-layer space over dozens of layers does not reject almost every trial. Anything the format still
rejects is pruned before evaluation.

Fixed point's ``frac_width`` may be ``"auto"`` (the most fraction bits that still cover the range: per output
row of a weight, per tensor for a calibrated activation); a trial that quantizes an activation that way gets
a calibration step. Bound to a graph, the space warns (:class:`QuantizationWarning`) when even its finest
fixed-point choice rounds most of a layer's weights to zero: no trial of such a space can keep that layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..passes.quantize.config import QUANTIZABLE_OPS, QuantizeConfig, RoleSpec
from ..passes.quantize.formats import AUTO, ROLES, QuantizeConfigError, check_role_params, get_format
from ..passes.quantize.quantizer import Quantize
from ..passes.quantize.zeroed import ZEROED_THRESHOLD, warn_zeroed, zero_fraction
from ..passes.select import select_nodes
from .errors import SearchError
from .priors import BIT_BUDGETS, allocations, allowed_choices, check_prior_args, pick_params, sensitivity_bound
from .space import SPACES, SearchSpace, TrialPlan, check_choices, unknown_keys

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph
    from ..passes.analysis.sensitivity_types import SensitivityInfo

__all__ = ["AUTO_FIXED_POINT", "MixedPrecisionSpace", "TUTORIAL_FIXED_POINT"]

MAX_COMBINATIONS = 20_000  # above this many choice combinations per format, sample freely and prune
# MASE tutorials 6/10: fixed-point widths and fraction widths, drawn independently per layer. On a pretrained
# transformer these fraction widths are too coarse (MiniLM's pooler and classifier weights all round to 0 at
# frac_width 5, the finest): the mixed-precision example searches AUTO_FIXED_POINT instead.
TUTORIAL_FIXED_POINT: dict[str, list[int]] = {"width": [2, 3, 4, 6, 8], "frac_width": [1, 2, 3, 4, 5]}
# Fixed-point widths with every fraction width chosen from the range (frac_width "auto").
AUTO_FIXED_POINT: dict[str, list[Any]] = {"width": [4, 6, 8], "frac_width": [AUTO]}


class MixedPrecisionSpace(SearchSpace):
    """Search quantization formats per layer or per op type.

    Args:
        formats: format name → parameters (list = searched, scalar = fixed), e.g.
            ``{"integer": {"width": [4, 8, 16], "frac_width": [2, 4, 8]}}`` or ``"frac_width": "auto"``.
        roles: which operands are quantized with the sampled parameters (each role samples its own).
        per: ``"layer"`` (one choice per layer of the target op types) or ``"type"`` (one per op type).
        targets: canonical op types to quantize (default ``["linear"]``).
        calibrate: add a calibration step (needed by static scaled formats; added anyway to a trial whose
            activations take ``frac_width: "auto"``).
        lower_int8: add int8 lowering (real int8 kernels; only meaningful for 8-bit integer formats).
        qat: quantization-aware training: quantize before the trial's fine-tune (after pruning), which then
            trains through the quantizers (straight-through gradients) instead of quantizing the trained
            weights afterwards. Every trial fine-tunes, so the task must be able to train.
        prior: ``"sensitivity"`` (per='layer'): measure each layer's sensitivity once per study, keep each
            layer's widths within ``loss_bound`` and enqueue sensitivity-ranked allocations (search/priors.py).
        loss_bound: the estimated loss increase a layer's width may cost (default: half the baseline loss).
    """

    kind = "precision"

    def __init__(self, formats: Mapping[str, Mapping[str, Any]], roles: Sequence[str] = ("data_in", "weight", "bias"),
                 per: Literal["layer", "type"] = "type", targets: Sequence[str] = ("linear",),
                 calibrate: bool = False, lower_int8: bool = False, layers: Sequence[str] = (),
                 qat: bool = False, prior: str | None = None, loss_bound: float | None = None) -> None:
        if not isinstance(formats, Mapping) or not formats:
            raise SearchError("precision space: 'formats' must name at least one format")
        self.formats: dict[str, dict[str, tuple[Any, ...]]] = {}
        for name, params in formats.items():
            if not isinstance(params, Mapping):
                raise SearchError(f"precision space: format {str(name)[:40]!r} must be a table of parameter choices, "
                                  f"got {type(params).__name__}")
            try:
                fmt = get_format(name)
            except QuantizeConfigError as exc:
                raise SearchError(f"precision space: {exc}") from None
            bad = sorted(set(params) - set(fmt.param_names))
            if bad:
                raise SearchError(f"precision space: format {name!r} has no parameter(s) {bad}; "
                                  f"parameters: {list(fmt.param_names)}")
            self.formats[name] = {p: check_choices(f"{name}.{p}", v if isinstance(v, list | tuple) else [v])
                                  for p, v in params.items()}
            _check_each_choice(name, self.formats[name])
        self._allowed = {name: _allowed_after(name, choices) for name, choices in self.formats.items()}
        bad_roles = [r for r in roles if r not in ROLES]
        if bad_roles or not roles:
            raise SearchError(f"precision space: roles must be a non-empty subset of {list(ROLES)}, got {list(roles)}")
        if per not in ("layer", "type"):
            raise SearchError(f"precision space: 'per' must be 'layer' or 'type', got {per!r}")
        bad_ops = [t for t in targets if t not in QUANTIZABLE_OPS]
        if bad_ops or not targets:
            raise SearchError(f"precision space: unknown op type(s) {bad_ops}; quantizable: {list(QUANTIZABLE_OPS)}")
        self.roles, self.per, self.targets = tuple(roles), per, tuple(targets)
        self.calibrate, self.lower_int8, self.layers = bool(calibrate), bool(lower_int8), tuple(layers)
        self.qat = bool(qat)
        check_prior_args("precision", prior, loss_bound)
        self.prior, self.loss_bound = prior, loss_bound
        self.prior_format = self._prior_format() if prior is not None else None
        self.widths_by_layer: dict[str, tuple[int, ...]] = {}  # the prior's restriction, set by with_sensitivity
        self.layer_loss: dict[str, dict[int, float]] = {}
        self.layer_params: dict[str, int] = {}

    def bind(self, graph: ForgeGraph | None) -> MixedPrecisionSpace:
        if graph is not None:
            self.warn_zeroed_weights(graph)
        if self.per == "type" or graph is None:
            return self
        layers = tuple(dict.fromkeys(name for _, name, _, _ in select_nodes(graph.model, {"type": list(self.targets)})))
        if not layers:
            raise SearchError(f"precision space: the graph has no layer of type {list(self.targets)}")
        bound = MixedPrecisionSpace.__new__(MixedPrecisionSpace)
        bound.__dict__.update(self.__dict__)
        bound.layers = layers
        return bound

    def keys(self) -> tuple[str, ...]:
        if self.per == "type":
            return self.targets
        if not self.layers:
            raise SearchError("precision space with per='layer' must be bound to a graph first")
        return self.layers

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        import optuna

        config: dict[str, Any] = {"by": "type" if self.per == "type" else "name",
                                  "default": {"config": {"name": None}}}
        names = list(self.formats)
        for key in self.keys():
            fmt = names[0] if len(names) == 1 else trial.suggest_categorical(f"{key}:format", names)
            entry: dict[str, Any] = {"name": fmt}
            for role in self.roles:
                for param, value in self._sample_role(trial, f"{key}:{fmt}:{role}", fmt,
                                                      self._prior_widths(key, fmt, role)).items():
                    entry[f"{role}_{param}"] = value
            config[key] = {"config": entry}
        try:
            QuantizeConfig.from_dict(config)
        except QuantizeConfigError as exc:
            raise optuna.TrialPruned(f"invalid format combination: {exc}") from None
        steps: list[tuple[str, Mapping[str, Any]]] = [("quantize_transform_pass", config)]
        if self.calibrate or _auto_activation(config):
            steps.append(("calibrate_analysis_pass", {}))
        if self.lower_int8:
            steps.append(("lower_int8_transform_pass", {}))
        return TrialPlan(tuple(steps), train=self.qat, qat=self.qat)

    def finest_weight_specs(self) -> list[RoleSpec]:
        """Per fixed-point width of the space, its finest weight choices: the largest fraction width the width
        admits (fewer fraction bits only round more weights to zero) and ``"auto"`` if offered."""
        choices = self.formats.get("integer")
        if choices is None or "weight" not in self.roles:
            return []
        specs = []
        for width in (w for w in choices.get("width", ()) if type(w) is int):  # other choices are pruned per trial
            fracs = [f for f in choices.get("frac_width", ()) if f == AUTO or type(f) is int and f <= width]
            ints = [f for f in fracs if f != AUTO]
            for frac in ([max(ints)] if ints else []) + ([AUTO] if AUTO in fracs else []):
                specs.append(RoleSpec("integer", (("frac_width", frac), ("width", width))))
        # the likeliest to keep a layer first ("auto", then the finest step), so most layers take one check
        return sorted(specs, key=lambda s: (s.p["frac_width"] != AUTO, -s.p["frac_width"] if s.p["frac_width"] != AUTO
                                            else 0, -s.p["width"]))

    def warn_zeroed_weights(self, graph: ForgeGraph) -> list[tuple[str, float]]:
        """The target layers (name, least fraction of weights zeroed) whose weights mostly round to zero under
        every fixed-point choice of the space, warned about with a QuantizationWarning (before any trial runs)."""
        specs = self.finest_weight_specs()
        if not specs:
            return []
        zeroed = []
        for _, name, module, _ in select_nodes(graph.model, {"type": list(self.targets)}, modules_only=True):
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
                continue
            best = 1.0
            with torch.no_grad():
                for spec in specs:
                    quantized = Quantize(spec, "weight", is_param=True, channel_axis=0)(weight)  # per output row
                    best = min(best, zero_fraction(weight, quantized))
                    if best <= ZEROED_THRESHOLD:
                        break
            if best > ZEROED_THRESHOLD:
                zeroed.append((name, best))
        warn_zeroed(f"precision space {dict(self.formats['integer'])} (even its finest choice)", zeroed, stacklevel=4)
        return zeroed

    def _sample_role(self, trial: optuna.trial.BaseTrial, prefix: str, fmt: str,
                     widths: tuple[int, ...] | None = None) -> dict[str, Any]:
        """One role's parameters in order, each from the choices the earlier ones leave valid; a restricted
        parameter's name carries the values that restrict it, so a name always has the same choices (the
        prior's per-layer ``widths`` are fixed for the study, so that restriction keeps the plain name)."""
        chosen: dict[str, Any] = {}
        table = self._allowed[fmt]
        for param, values in self.formats[fmt].items():
            allowed = values if table is None else table[tuple(chosen.values())]
            if param == "width" and widths is not None:
                allowed = tuple(v for v in allowed if v in widths) or allowed
            if len(allowed) == 1:
                chosen[param] = allowed[0]
                continue
            name = f"{prefix}_{param}"
            restricting = ",".join(f"{k}={v}" for k, v in chosen.items() if len(self.formats[fmt][k]) > 1)
            if allowed != values and restricting:  # (a restriction by fixed values alone is always the same)
                name += "|" + restricting
            chosen[param] = trial.suggest_categorical(name, list(allowed))
        return chosen

    def to_spec(self) -> dict[str, Any]:
        formats = {f: {p: list(v) for p, v in ps.items()} for f, ps in self.formats.items()}
        spec = {"kind": self.kind, "formats": formats,
                "roles": list(self.roles), "per": self.per, "targets": list(self.targets),
                "calibrate": self.calibrate, "lower_int8": self.lower_int8}
        if self.qat:  # only when set, so studies stored before the option existed resume with an equal spec
            spec["qat"] = True
        if self.prior is not None:
            spec["prior"] = self.prior
        if self.loss_bound is not None:
            spec["loss_bound"] = self.loss_bound
        return spec

    # -- the sensitivity prior (search/priors.py) ------------------------------------------------------------
    def _prior_format(self) -> str:
        """The format whose widths the prior allocates: ``integer`` if searched, else the first with int widths."""
        if self.per != "layer":
            raise SearchError("precision space: prior='sensitivity' allocates widths per layer: use per='layer'")
        for fmt in sorted(self.formats, key=lambda f: f != "integer"):
            if len(self._widths(fmt)) > 1:
                return fmt
        raise SearchError("precision space: prior='sensitivity' needs a format with at least two integer 'width' "
                          f"choices, got {dict(self.formats)}")

    def _prior_widths(self, key: str, fmt: str, role: str) -> tuple[int, ...] | None:
        """The widths the prior leaves a layer's weight (what the sensitivity measured); None: unrestricted."""
        return self.widths_by_layer.get(key) if fmt == self.prior_format and role == "weight" else None

    def _widths(self, fmt: str) -> tuple[int, ...]:
        return tuple(sorted({w for w in self.formats[fmt].get("width", ()) if type(w) is int}))

    def sensitivity_request(self) -> dict[str, Any]:
        """What sensitivity_analysis_pass must measure for this space: its widths, format and op types."""
        assert self.prior_format is not None
        return {"widths": self._widths(self.prior_format), "format": self.prior_format,
                "targets": {"type": list(self.targets)}}

    def with_sensitivity(self, info: SensitivityInfo, graph: ForgeGraph | None = None) -> MixedPrecisionSpace:
        """A copy whose layers keep only the widths within the loss bound (the widest always); SearchError when
        the measurement does not cover every layer and width (e.g. a study stored for another model)."""
        assert self.prior_format is not None
        by_name = {layer.name: layer for layer in info.layers}
        widths, bound = self._widths(self.prior_format), sensitivity_bound(info, self.loss_bound)
        shaped = MixedPrecisionSpace.__new__(MixedPrecisionSpace)
        shaped.__dict__.update(self.__dict__)
        shaped.widths_by_layer, shaped.layer_loss, shaped.layer_params = {}, {}, {}
        for key in self.keys():
            layer = by_name.get(key)
            if layer is None:
                raise SearchError(f"precision space: the sensitivity measured has no layer {key!r} (it has "
                                  f"{sorted(by_name)[:8]}...): it was measured on another model; start a new study")
            try:
                loss = {w: layer.delta(w) for w in widths}
            except KeyError as exc:
                raise SearchError(f"precision space: {exc.args[0]}; start a new study") from None
            shaped.layer_loss[key], shaped.layer_params[key] = loss, layer.params
            shaped.widths_by_layer[key] = allowed_choices(loss, max(widths), bound)
        return shaped

    def prior_allocations(self) -> list[dict[str, Any]]:
        """The space's parameters for each sensitivity-ranked width allocation at :data:`BIT_BUDGETS` average
        weight bits (weighted by each layer's parameter count)."""
        keys = self.keys()
        options = [[(w, float(w * self.layer_params[k]), self.layer_loss[k][w]) for w in self.widths_by_layer[k]]
                   for k in keys]
        total = sum(self.layer_params[k] for k in keys)
        return [pick_params(self, _allocation_rule(self.prior_format or "", dict(zip(keys, widths))))
                for widths in allocations(options, [b * total for b in BIT_BUDGETS])]


def _allocation_rule(fmt: str, widths: Mapping[str, int]) -> Any:
    """Answers a precision space's parameters for one width allocation: the prior's format, the layer's width
    for its weight and the widest for the other roles (the sensitivity measures weights only), ``"auto"``
    fraction bits if offered (else the finest for weights and bias, half the width for activations), any
    other parameter its first choice."""
    role_widths: dict[str, int] = {}  # the width answered for each layer's role (asked before its frac_width)

    def rule(name: str, choices: Sequence[Any]) -> Any:
        key, _, rest = name.partition(":")
        if rest == "format":
            return fmt
        role_param = rest.split("|")[0].split(":")[-1]
        role = next(r for r in sorted(ROLES, key=len, reverse=True) if role_param.startswith(r + "_"))
        param, ints = role_param[len(role) + 1:], sorted(c for c in choices if type(c) is int)
        if param == "width":
            width = widths[key] if role == "weight" else max(ints, default=widths[key])
            answer = width if width in choices or not ints else next((c for c in ints if c >= width), ints[-1])
            role_widths[f"{key}:{role}"] = answer if type(answer) is int else widths[key]
            return answer if answer in choices else choices[0]
        if param == "frac_width":
            if AUTO in choices or not ints:
                return AUTO if AUTO in choices else choices[0]
            width = role_widths.get(f"{key}:{role}", widths[key])
            return ints[-1] if role in ("weight", "bias") else min(ints, key=lambda c: abs(c - width / 2))
        return choices[0]

    return rule


def _auto_activation(config: Mapping[str, Any]) -> bool:
    """Does a quantize config take an activation's fraction width from calibration (``frac_width: "auto"``)?"""
    return any(entry["config"].get(f"{role}_frac_width") == AUTO for key, entry in config.items()
               if isinstance(entry, Mapping) and "config" in entry for role in ("data_in", "data_out"))


def _check_each_choice(fmt: str, choices: Mapping[str, tuple[Any, ...]]) -> None:
    """Every choice of every parameter passes the format's own check of that parameter (type, range): a
    choice no trial could use is refused naming it, rather than silently never sampled."""
    params = {p.name: p for p in get_format(fmt).params}
    for name, values in choices.items():
        for value in values:
            try:
                params[name].check(value, f"{fmt}.{name}")
            except QuantizeConfigError as exc:
                raise SearchError(f"precision space: {fmt}.{name} choice {value!r} is invalid: {exc}") from None


def _allowed_after(fmt: str, choices: Mapping[str, tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[Any, ...]] | None:
    """For every prefix of values the format can still complete validly, the values the next parameter may
    take (in choice order); None when there are too many combinations to list (then sample freely). A choice
    that is valid with no combination of the others is refused (it would never be sampled)."""
    total = 1
    for values in choices.values():
        total *= len(values)
    if total > MAX_COMBINATIONS:
        return None
    fmt_def = get_format(fmt)
    allowed: dict[tuple[Any, ...], dict[Any, None]] = {}
    why: dict[tuple[str, Any], str] = {}  # (parameter, choice) → why its last combination was invalid
    used: set[tuple[str, Any]] = set()
    for combo in itertools.product(*choices.values()):
        try:
            check_role_params(fmt_def, dict(zip(choices, combo)), fmt)
        except QuantizeConfigError as exc:
            why.update(((name, value), str(exc)) for name, value in zip(choices, combo))
            continue
        used.update(zip(choices, combo))
        for i, value in enumerate(combo):  # product order keeps each prefix's next values in choice order
            allowed.setdefault(combo[:i], {})[value] = None
    if not allowed:
        raise SearchError(f"precision space: no combination of the {fmt!r} choices {dict(choices)} is valid")
    for name, values in choices.items():
        for value in values:
            if (name, value) not in used:
                raise SearchError(f"precision space: {fmt}.{name} choice {value!r} fits no combination of the other "
                                  f"choices {dict(choices)} (e.g. {why[name, value]}); drop it")
    return {prefix: tuple(values) for prefix, values in allowed.items()}


def _from_spec(spec: Mapping[str, Any]) -> MixedPrecisionSpace:
    unknown_keys("precision", spec, ("formats", "roles", "per", "targets", "calibrate", "lower_int8", "qat",
                                     "prior", "loss_bound"))
    if "formats" not in spec:
        raise SearchError("precision space needs 'formats'")
    return MixedPrecisionSpace(**dict(spec))


SPACES["precision"] = _from_spec
