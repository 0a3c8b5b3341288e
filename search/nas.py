"""NASSpace: architecture search over a HuggingFace config by its real field names.

MASE's tutorial sets ``config.num_layers`` / ``config.num_heads`` — names BertConfig does not have,
so those choices silently did nothing. Here every field is checked against the config class (an
unknown field is a SearchError before the study starts, and so is a choice the model cannot be built
with, e.g. a negative size), a combination the model cannot build (hidden size not divisible by the
heads) is pruned before any training, and a Linear whose input and
output widths match may optionally be replaced by ``nn.Identity`` per trial. With ``init_from`` each
trial's model inherits a pretrained donor's weights (``nas_inherit``) instead of starting from random ones.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from .errors import SearchError
from .space import SPACES, SearchSpace, TrialPlan, check_choices, unknown_keys

if TYPE_CHECKING:
    import optuna

    from ..graph.forge_graph import ForgeGraph

__all__ = ["NASSpace", "build_config", "config_fields", "resolve_hf_class"]

MAX_CHECK_BUILDS = 16  # combinations tried per choice when checking that it can build (before any trial)


def resolve_hf_class(name: str, base: str) -> type:
    """A transformers class by name that subclasses ``transformers.<base>`` (nothing else is reachable)."""
    import transformers

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise SearchError(f"{name!r} is not a class name")
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, getattr(transformers, base)):
        raise SearchError(f"{name!r} is not a transformers {base} class")
    return cls


def build_config(config_class: str, base: Mapping[str, Any], overrides: Mapping[str, Any]) -> Any:
    """``ConfigClass(**base)`` with ``overrides`` set; every key must be a real field of the class."""
    cls = resolve_hf_class(config_class, "PretrainedConfig")
    config = cls(**dict(base))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def config_fields(cls: type) -> set[str]:
    """Names a config class really uses: its serialised fields, its ``attribute_map`` aliases (GPT2's
    ``num_hidden_layers`` → ``n_layer``) and public properties with a setter (``num_labels``, stored as
    ``id2label``, is not in ``to_dict()``)."""
    import inspect

    defaults = cls()
    settable = {k for k in dir(cls) if not k.startswith("_")
                and isinstance(inspect.getattr_static(cls, k), property) and inspect.getattr_static(cls, k).fset}
    return set(defaults.to_dict()) | set(getattr(cls, "attribute_map", {})) | settable


class NASSpace(SearchSpace):
    """Choose HF config fields (``{"num_hidden_layers": [2, 4], ...}``) and optionally Identity linears.

    Args:
        config_class: the transformers config class name, e.g. ``"BertConfig"``.
        choices: field name → list of values.
        base: fixed config fields (e.g. ``vocab_size``, ``num_labels``).
        model_class: the transformers model class built from the config per trial.
        identity: regexes over Linear module paths that may become ``nn.Identity`` (only where the
            layer's input and output widths are equal, so shapes still fit).
        init_from: a pretrained model (HF name, local directory, or ``"minilm"``) whose weights every
            trial's model inherits, sliced to its widths and spread over its depth (``nas_inherit``).
    """

    kind = "nas"

    def __init__(self, config_class: str, choices: Mapping[str, Sequence[Any]], base: Mapping[str, Any] | None = None,
                 model_class: str = "AutoModelForSequenceClassification",
                 identity: Sequence[str] = (), init_from: str | None = None) -> None:
        if init_from is not None and (not isinstance(init_from, str) or not init_from.strip()):
            raise SearchError(f"nas space: init_from must be a model name or directory, got {init_from!r}")
        self.init_from = init_from
        self.config_class = config_class
        self.base = dict(base or {})
        self.model_class = model_class
        self.choices = {str(k): check_choices(f"nas choice {k!r}", v) for k, v in dict(choices).items()}
        if not self.choices:
            raise SearchError("nas space: 'choices' is empty: name at least one config field to search")
        fields = config_fields(resolve_hf_class(config_class, "PretrainedConfig"))
        unknown = sorted(k for k in (*self.choices, *self.base) if k not in fields)
        if unknown:
            close = sorted({f for u in unknown for f in difflib.get_close_matches(u, fields, n=4, cutoff=0.6)}
                           | {f for f in fields if any(u.split("_")[-1] in f for u in unknown)})[:8]
            raise SearchError(f"{config_class} has no field(s) {unknown} (setting them would silently do nothing); "
                              f"similar fields: {close}")
        self.identity = tuple(re.compile(p) for p in identity)

    def bind(self, graph: ForgeGraph | None) -> NASSpace:
        """Refuse, before any trial, a choice with which the model cannot be built (a negative or zero size,
        a float where the config wants an int ...): each choice must build, on the meta device (no memory),
        with some choice of the other fields that the sampler would not prune; and load ``init_from``."""
        import itertools

        import torch

        if self.init_from is not None:
            from .nas_inherit import load_donor

            load_donor(self.init_from)

        fields = list(self.choices)
        good: set[tuple[str, Any]] = set()
        for field in fields:
            for value in self.choices[field]:
                if (field, value) in good:
                    continue
                error = "every combination with it is pruned"
                others = [self.choices[f] if f != field else (value,) for f in fields]
                for combo in itertools.islice(itertools.product(*others), MAX_CHECK_BUILDS):
                    overrides = dict(zip(fields, combo))
                    if _pruned_because({**self.base, **overrides}):
                        continue
                    try:
                        with torch.device("meta"):
                            self._build(overrides, (), inherit=False)
                    except Exception as exc:  # whatever the config or the model's constructor raises
                        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                        continue
                    good.update(overrides.items())
                    break
                if (field, value) not in good:
                    raise SearchError(f"nas space: {field} = {value!r} cannot build {self.model_class} from "
                                      f"{self.config_class} ({error}); drop that choice")
        return self

    def suggest(self, trial: optuna.trial.BaseTrial) -> TrialPlan:
        import optuna

        values = {k: trial.suggest_categorical(k, list(v)) for k, v in self.choices.items()}
        merged = {**self.base, **values}
        reason = _pruned_because(merged)
        if reason is not None:
            raise optuna.TrialPruned(reason)
        identity: list[str] = []
        if self.identity:
            for path in self.identity_candidates(merged):
                if trial.suggest_categorical(f"identity:{path}", ["linear", "identity"]) == "identity":
                    identity.append(path)
        return TrialPlan(train=True, model_config=values, identity_layers=tuple(identity))

    def identity_candidates(self, overrides: Mapping[str, Any]) -> list[str]:
        """Linear paths matching ``identity`` whose in/out widths are equal, for this configuration."""
        model = self._build(overrides, (), inherit=False)
        return [p for p, m in model.named_modules() if isinstance(m, nn.Linear)
                and m.in_features == m.out_features and any(r.fullmatch(p) for r in self.identity)]

    def build_model(self, overrides: Mapping[str, Any], identity_layers: Sequence[str]) -> nn.Module:
        """A model of this configuration (freshly initialised, or inheriting ``init_from``'s weights), with the
        chosen layers made Identity."""
        return self._build(overrides, identity_layers, inherit=self.init_from is not None)

    def _build(self, overrides: Mapping[str, Any], identity_layers: Sequence[str], inherit: bool) -> nn.Module:
        config = build_config(self.config_class, self.base, overrides)
        cls = resolve_hf_class(self.model_class, "PreTrainedModel") if not self.model_class.startswith("Auto") \
            else _auto_class(self.model_class)
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        if inherit and self.init_from is not None:
            from .nas_inherit import inherit_weights, load_donor

            inherit_weights(model, load_donor(self.init_from), int(getattr(config, "num_hidden_layers", 1) or 1))
        for path in identity_layers:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, nn.Identity())
        return model.eval()

    @property
    def needs_graph(self) -> bool:
        return False

    def to_spec(self) -> dict[str, Any]:
        spec = {"kind": self.kind, "config_class": self.config_class, "choices": {k: list(v) for k, v in
                self.choices.items()}, "base": dict(self.base), "model_class": self.model_class,
                "identity": [r.pattern for r in self.identity]}
        return spec if self.init_from is None else {**spec, "init_from": self.init_from}


def _pruned_because(config: Mapping[str, Any]) -> str | None:
    """Why a combination is pruned before training (the model could not split its heads), or None."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and hidden % heads:
        return f"hidden_size {hidden} is not divisible by num_attention_heads {heads}"
    return None


def _auto_class(name: str) -> Any:
    import transformers

    if not re.fullmatch(r"AutoModel[A-Za-z]*", name) or not hasattr(transformers, name):
        raise SearchError(f"{name!r} is not a transformers AutoModel class")
    return getattr(transformers, name)


def _from_spec(spec: Mapping[str, Any]) -> NASSpace:
    unknown_keys("nas", spec, ("config_class", "choices", "base", "model_class", "identity", "init_from"))
    if "config_class" not in spec or "choices" not in spec:
        raise SearchError("nas space needs 'config_class' and 'choices'")
    return NASSpace(**dict(spec))


SPACES["nas"] = _from_spec
